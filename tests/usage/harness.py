"""Service-level test rig: simulated time, a node's pods on the fake apiserver, and their true intervals.

A :class:`~region_agent.base.clock.ManualClock` is the service's clock *and* sleep: timers only
fire when the test advances it, so a test can play ten minutes in a fraction of a second, and
every pod timestamp the test writes (whole seconds of its wall time) is exactly the time the agent
sees. The test waits for the agent to process each change (:meth:`Rig.sync`) before moving time on,
so the billed seconds must equal the true ones exactly.
Network I/O (the fake apiserver, the fake control plane) stays real, on loopback.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import ApiClient, Configuration
from prometheus_client import CollectorRegistry

from region_agent.base.clock import ManualClock
from region_agent.kube.resources import PODS
from region_agent.kube.settings import WatchSettings
from region_agent.kube.watch import Informer
from region_agent.usage.pods import MeteredPod
from region_agent.usage.service import UsageService
from region_agent.usage.settings import UsageSettings
from region_agent.usage.wiring import build_usage
from tests.conftest import wait_for
from tests.fakes.control_plane import FakeControlPlane
from tests.fakes.kube_api import FakeKubeApi
from tests.usage.factory import down, pod, running, up, waiting

NODE = "node-a"
REGION = "sfo1"

WATCH = WatchSettings(server_timeout_min=30, server_timeout_max=30, read_margin=5.0, connect_timeout=2.0,
                      list_timeout=5.0, backoff_initial=0.01, backoff_cap=0.05, backoff_reset_after=5.0,
                      very_short_watch=0.0)


@dataclass
class Truth:
    """What the pods really did: uid → running intervals [start, end)."""

    spans: dict[str, list[list[int]]] = field(default_factory=dict)

    def open(self, uid: str, at: int) -> None:
        self.spans.setdefault(uid, []).append([at, -1])

    def close(self, uid: str, at: int) -> None:
        span = self.spans[uid][-1]
        assert span[1] == -1, f"{uid} is not running"
        span[1] = at

    def seconds_by_pod(self) -> dict[str, int]:
        out = {uid: sum(e - s for s, e in spans if e != -1) for uid, spans in self.spans.items()}
        return {uid: s for uid, s in out.items() if s > 0}

    @property
    def total(self) -> int:
        return sum(self.seconds_by_pod().values())


@dataclass
class Node:
    """The pods of one node on the fake apiserver, with their truth kept in step."""

    fake: FakeKubeApi
    clock: ManualClock
    truth: Truth = field(default_factory=Truth)
    restarts: dict[str, int] = field(default_factory=dict)
    since: dict[str, int] = field(default_factory=dict)

    @property
    def now(self) -> int:
        """The clock's wall time in whole seconds, as pod timestamps carry it."""
        return int(self.clock.wall())

    @staticmethod
    def uid(name: str) -> str:
        return f"uid-{name}"

    def start(self, name: str, **kw: Any) -> None:
        now = self.now
        self.since[name] = now
        self.restarts[name] = 0
        self.fake.put(PODS, up(now, name=name, uid=self.uid(name), node=NODE, **kw))
        self.truth.open(self.uid(name), now)

    def crash(self, name: str) -> None:
        """The user container dies and waits to restart (CrashLoopBackOff); the pod stays."""
        now = self.now
        self.restarts[name] += 1
        self.fake.put(PODS, pod(name, uid=self.uid(name), node=NODE, statuses=[
            waiting(restarts=self.restarts[name], last_finished=now), running(self.since[name])]))
        self.truth.close(self.uid(name), now)

    def recover(self, name: str) -> None:
        now = self.now
        self.fake.put(PODS, pod(name, uid=self.uid(name), node=NODE, statuses=[
            running(now, restarts=self.restarts[name], last_finished=now), running(self.since[name])]))
        self.truth.open(self.uid(name), now)

    def finish(self, name: str, *, running_now: bool = True) -> None:
        now = self.now
        self.fake.put(PODS, down(now, name=name, uid=self.uid(name), node=NODE))
        if running_now:
            self.truth.close(self.uid(name), now)

    def begin_delete(self, name: str, grace: int = 0) -> None:
        """Graceful deletion: deletionTimestamp set; the pod runs until it (the truth's end)."""
        self.fake.put(PODS, up(self.since[name], name=name, uid=self.uid(name), node=NODE,
                               deletion=self.now + grace))

    def remove(self, name: str) -> None:
        self.fake.delete(PODS, "shop", name)


@dataclass
class Rig:
    fake: FakeKubeApi
    plane: FakeControlPlane
    clock: ManualClock
    node: Node
    registry: CollectorRegistry
    settings: UsageSettings
    informer: Informer[MeteredPod]
    service: UsageService
    tasks: list[asyncio.Task[Any]]

    @property
    def now(self) -> int:
        return self.node.now

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def caught_up(self, timeout: float = 5.0) -> None:
        """Wait until the informer has seen every change of the fake (the events are queued)."""
        self.fake.bookmark()
        await wait_for(lambda: self.informer.resource_version == self.fake.resource_version,
                       timeout=timeout, message="informer caught up")

    async def sync(self, timeout: float = 5.0) -> None:
        """Wait until the informer has seen every change of the fake and the service applied it."""
        self.fake.bookmark()
        await wait_for(lambda: self.informer.resource_version == self.fake.resource_version and self.service.idle,
                       timeout=timeout, message="informer caught up and service idle")

    async def advance(self, seconds: float, *, step: float = 5.0) -> None:
        """Move simulated time in steps, letting timers fire and the service apply each step."""
        remaining = seconds
        while remaining > 0:
            dt = min(step, remaining)
            self.clock.advance(dt)
            remaining -= dt
            await self._let_run()

    async def _let_run(self, *, until_idle: bool = True) -> None:
        for _ in range(3):  # woken timers enqueue their work on the next loop turns
            await asyncio.sleep(0)
        if until_idle:
            await wait_for(lambda: self.service.idle, timeout=5.0, message="service idle")

    async def advance_until(self, condition: Callable[[], bool], *, step: float = 5.0, timeout: float = 20.0,
                            message: str = "condition") -> None:
        """Advance time step by step until ``condition`` holds (deadline in real seconds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not condition():
            if loop.time() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {message}")
            self.clock.advance(step)
            await self._let_run(until_idle=False)  # the service may itself wait on simulated time
            await asyncio.sleep(0.005)  # poll interval: lets loopback HTTP to the fake control plane progress

    def delivered(self) -> bool:
        return (self.plane.seconds_by_pod() == self.node.truth.seconds_by_pod()
                and self.metric("region_agent_usage_spool_unsent_records") == 0
                and self.plane.in_flight == 0)

    def assert_billed_exactly(self) -> None:
        assert not self.plane.conflicts, self.plane.conflicts[:3]
        assert not self.plane.malformed, self.plane.malformed[:3]
        assert not self.plane.overlaps(), self.plane.overlaps()[:3]
        assert self.plane.seconds_by_pod() == self.node.truth.seconds_by_pod()
        assert self.plane.total_seconds == self.node.truth.total
        assert self.metric("region_agent_usage_spool_unsent_records") == 0
        assert self.metric("region_agent_usage_spool_quarantined_records") == 0


def usage_settings(tmp_path: Path, plane: FakeControlPlane, **overrides: Any) -> UsageSettings:
    values: dict[str, Any] = {
        "spool_path": str(tmp_path / "spool" / "usage.sqlite3"), "endpoint_url": plane.url,
        "token": "test-token", "token_file": None, "checkpoint_interval": 60.0, "report_interval": 2.0,
        "batch_size": 25, "request_timeout": 0.25, "backoff_initial": 1.0, "backoff_cap": 60.0,
        "commit_delay": 0.0,
    }
    values.update(overrides)
    return UsageSettings(**values)


@asynccontextmanager
async def rig(tmp_path: Path, *, ready: bool = True, **overrides: Any) -> AsyncIterator[Rig]:
    """Fake apiserver + fake control plane + informer + usage service on simulated time.

    ``ready=False``: do not wait for the service to reconcile (its spool may be unavailable).
    """
    fake = FakeKubeApi()
    await fake.start()
    plane = FakeControlPlane(stall_for=0.5)
    await plane.start()
    clock = ManualClock()
    settings = usage_settings(tmp_path, plane, **overrides)
    async with ApiClient(Configuration(host=fake.url)) as api:
        current: Rig | None = None
        try:
            current = await start_service(fake, plane, clock, settings, api, ready=ready)
            yield current
        finally:
            if current is not None:
                await stop_service(current)
            plane.release()
            await plane.stop()
            plane.close_placeholder()
            await fake.close()


async def start_service(fake: FakeKubeApi, plane: FakeControlPlane, clock: ManualClock, settings: UsageSettings,
                        api: Any, node: Node | None = None, *, ready: bool = True) -> Rig:
    registry = CollectorRegistry()
    informer, service = build_usage(settings, api=api, registry=registry, region=REGION, node=NODE, watch=WATCH,
                                    clock=clock, sleep=clock.sleep)
    tasks = [asyncio.create_task(informer.run(), name="test usage informer"),
             asyncio.create_task(service.run(), name="test usage service")]
    if ready:
        await wait_for(service.reconciled.is_set, timeout=5, message="usage service reconciled")
    else:
        await wait_for(informer.synced.is_set, timeout=5, message="pod watch synced")
    return Rig(fake, plane, clock, node or Node(fake, clock), registry, settings, informer, service, tasks)


async def stop_service(current: Rig) -> None:
    """Graceful stop: cancel the service (it checkpoints), then the informer."""
    for task in reversed(current.tasks):
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
