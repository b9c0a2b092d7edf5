"""The DNS side of the agent: compile on every state change, answer on UDP and TCP.

:class:`ZoneService` listens to the store; a burst of changes (a zone file reload, a
gossip push-pull) is coalesced into one compilation on the next loop turn, and the new
tables replace the old ones in one assignment, so a query sees either the old zone or the
new one, never a mix.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.state.store import Entry, Store
from globaldns.answer import Responder, ResponderLimits
from globaldns.compiler import CompileReport, ZoneConfig, compile_zone
from globaldns.metrics import DnsCounters, register
from globaldns.server import DnsServer, TcpLimits
from globaldns.settings import DnsSettings
from globaldns.tables import Locator, ZoneHolder, ZoneTables

logger = logging.getLogger("region_agent.dns")


def zone_config(settings: DnsSettings) -> ZoneConfig:
    return ZoneConfig(
        apex=settings.zone, record_ttl=settings.record_ttl, ns_ttl=settings.ns_ttl, soa_ttl=settings.soa_ttl,
        soa_mname=settings.soa_mname, hostmaster=settings.hostmaster, refresh=settings.soa_refresh,
        retry=settings.soa_retry, expire=settings.soa_expire, minimum=settings.soa_minimum,
        startup_answer=settings.startup_answer,
    )


def open_locator(path: Path | None, store: Store) -> Locator | None:
    """The GeoIP proximity map over the regions' locations, or None without a database."""
    if path is None:
        return None
    from globaldns.geoip import GeoDatabase, ProximityMap, Site

    database = GeoDatabase.open(path)
    regions = store.snapshot().regions.values()
    sites = [Site(r.name, r.latitude, r.longitude) for r in regions
             if r.latitude is not None and r.longitude is not None]
    return ProximityMap(database, sites)


class ZoneService:
    def __init__(self, settings: DnsSettings, store: Store, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.store = store
        self.config = zone_config(settings)
        self.holder = ZoneHolder()
        self.counters = DnsCounters()
        register(self.counters, registry)
        self.responder = Responder(self.holder, self.counters, ResponderLimits(
            our_payload=settings.udp_payload, memo_entries=settings.response_memo_entries))
        self.server = DnsServer(
            self.responder, [(a, settings.port) for a in settings.listen_addresses],
            TcpLimits(settings.tcp_idle_timeout, settings.tcp_max_connections),
        )
        self.health_known = False
        self.locator: Locator | None = None
        self._locator_regions: object = None
        self._pending = False
        self.changed = asyncio.Event()  # set after every swap, for whoever publishes views
        store.subscribe(self._on_change)

    @property
    def tables(self) -> ZoneTables | None:
        return self.holder.tables

    def set_health_known(self) -> None:
        if not self.health_known:
            self.health_known = True
            self.rebuild()

    def _on_change(self, _entries: list[Entry]) -> None:
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self._rebuild_pending)

    def _rebuild_pending(self) -> None:
        self._pending = False
        self.rebuild()

    def rebuild(self) -> None:
        snapshot = self.store.snapshot()
        self._refresh_locator(snapshot.regions)
        report = CompileReport()
        tables = compile_zone(snapshot, self.config, health_known=self.health_known, locator=self.locator,
                              report=report)
        for problem in report.problems:
            logger.warning("zone: %s", problem)
        self.counters.zone_errors += len(report.problems)
        self.holder.replace(tables)
        self.counters.zone_serial = tables.serial
        self.counters.zone_reloads += 1
        self.changed.set()

    def _refresh_locator(self, regions: object) -> None:
        """Rebuild the proximity map when the regions (their locations) change."""
        if self.settings.geoip_database is None or regions == self._locator_regions:
            return
        self._locator_regions = regions
        self.locator = open_locator(self.settings.geoip_database, self.store)

    async def start(self) -> None:
        self.rebuild()
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()
