"""Builds the agent's components, starts them in dependency order, stops them in reverse.

Start order: state (zone file) → DNS (tables compiled before the sockets open, so no query
ever sees an empty zone) → health checks → health listener → background loops. A stop
(SIGTERM, SIGINT) cancels the loops and closes sockets in reverse order within the
shutdown budget. SIGHUP re-reads the zone file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any

from prometheus_client import CollectorRegistry

from agent.base.tasks import cancel_and_wait, create_guarded_task
from agent.checks.checker import Checker
from agent.settings import AgentSettings
from agent.state.hlc import HybridClock
from agent.state.local import RegionView
from agent.state.store import Store
from agent.zonefile import ZoneFileWatcher
from globaldns.service import ZoneService
from health.service import HealthService

logger = logging.getLogger("region_agent.supervisor")
VERSION = "0.1.0"


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.started_at = time.time()
        self.store = Store(writer=settings.writer_id, clock=HybridClock(lambda: int(time.time() * 1000)))
        self.zone_file: ZoneFileWatcher | None = None
        if settings.zone_file is not None:
            self.zone_file = ZoneFileWatcher(settings.zone_file, self.store, self.registry,
                                             poll_interval=settings.zone_file_poll_interval)
        self.dns = ZoneService(settings.dns, self.store, self.registry)
        self.checker = Checker(self.store, settings.checks.config(f"region-agent/{VERSION}"), self.registry)
        self.health = HealthService(settings.health, region=settings.region, registry=self.registry)
        self.ready = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._stop = asyncio.Event()
        self.store.subscribe(lambda _changes: self._on_state_change())

    def _on_state_change(self) -> None:
        self.checker.reconcile(self.store.snapshot())

    def region_view(self) -> RegionView:
        tables = self.dns.tables
        now = time.time()
        ready = self.ready.is_set()
        return RegionView(
            region=self.settings.region, started_at=self.started_at, generated_at=now, synced=ready,
            synced_at=now if ready else None, zone_serial=None if tables is None else tables.serial,
            zone_digest=self.store.digest(),
        )

    async def start(self) -> None:
        if self.zone_file is not None:
            self.zone_file.load()  # a bad file at start is fatal: there is no old zone to keep
        await self.dns.start()
        await self.health.start()
        self.health.publish(self.region_view())
        self._tasks.append(create_guarded_task(self.checker.run(), name="health checks"))
        self._tasks.append(create_guarded_task(self._publish_views(), name="view publisher"))
        self._tasks.append(create_guarded_task(self._become_ready(), name="readiness"))
        if self.zone_file is not None:
            self._tasks.append(create_guarded_task(self.zone_file.run(), name="zone file watcher"))

    async def _become_ready(self) -> None:
        await self.checker.first_round.wait()
        self.dns.set_health_known()
        self.ready.set()
        logger.info("ready: zone serial %s, first health round done",
                    self.dns.tables.serial if self.dns.tables else None)
        self.health.publish(self.region_view())
        await asyncio.Event().wait()

    async def _publish_views(self) -> None:
        while True:
            await self.dns.changed.wait()
            self.dns.changed.clear()
            self.health.publish(self.region_view())

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks, budget=self.settings.shutdown_budget)
        with contextlib.suppress(Exception):
            await self.health.stop()
        await self.dns.stop()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, stop."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        if self.zone_file is not None:
            loop.add_signal_handler(signal.SIGHUP, self.zone_file.request_reload)
        try:
            await self.start()
            await self._stop.wait()
            logger.info("stopping")
        finally:
            await self.stop()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
