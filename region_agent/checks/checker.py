"""Standalone copy health: HTTP checks of every region's ingress, kept as this agent's observations.

One check loop per (address, URL) however many records use it, all started at boot (not
on the first query, PowerDNS's cold-start flaw), each on its own cadence from
:mod:`region_agent.checks.rule`. A copy (project, region) is healthy while any of the region's
addresses is up; the addresses that are not up are listed in
:attr:`CopyHealth.failed_addresses` so answers leave them out, as ifurlup does.

``first_round`` is set once every target has a known state; until then the zone answers
by the start-up rule and ``/readyz`` says not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from region_agent.checks.probe import CheckTarget, Outcome, new_session, probe
from region_agent.checks.rule import CheckRule, TargetHealth, TargetState
from region_agent.state.model import CopyHealth, Region, copy_key, region_key
from region_agent.state.observations import Observations
from region_agent.state.store import StateView, Store

logger = logging.getLogger("region_agent.checks")

@dataclass(frozen=True, slots=True)
class CheckConfig:
    port: int = 80
    host: str = "health.invalid"
    path: str = "/global-health/{slug}"
    expect: str = "ok"
    timeout: float = 2.0
    rule: CheckRule = field(default_factory=CheckRule)
    user_agent: str = "region-agent"
    max_concurrent: int = 128  # probes in flight at once

    def host_header(self) -> str:
        return self.host if self.port == 80 else f"{self.host}:{self.port}"


CopyId = tuple[str, str]  # (slug, region)


class CopySink(Protocol):
    """Where check results go: this agent's observations, or (a cluster's own region) the store."""

    def put(self, copy: CopyId, health: CopyHealth) -> bool: ...

    def forget(self, copies: list[CopyId]) -> None: ...


class StoreCopies:
    """Check results written into the replicated store as this agent's region, which owns them."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def put(self, copy: CopyId, health: CopyHealth) -> bool:
        return self._store.put(copy_key(*copy), health) is not None

    def forget(self, copies: list[CopyId]) -> None:
        self._store.put_many([(copy_key(*copy), None) for copy in copies])


def plan_targets(state: StateView, config: CheckConfig, *, skip_region: str | None = None,
                 only_region: str | None = None) -> dict[CheckTarget, set[CopyId]]:
    """Every (address, URL) to check and the copies whose health it decides (pure).

    ``skip_region`` is this agent's own region when its copies' health comes from the
    Kubernetes watch, which knows sooner and better than an HTTP check. ``only_region`` is this
    agent's own region in a gossip cluster without Kubernetes: it reports its own copies, and the
    other regions report theirs.
    """
    plan: dict[CheckTarget, set[CopyId]] = {}
    for slug, project in state.projects.items():
        path = config.path.format(slug=slug)
        for region_name in project.regions:
            region = state.regions.get(region_name)
            if region is None or region_name == skip_region or only_region not in (None, region_name):
                continue
            for address in region.ipv4 + region.ipv6:
                target = CheckTarget(address, config.port, config.host_header(), path)
                plan.setdefault(target, set()).add((slug, region_name))
    return plan


def copy_health(addresses: tuple[str, ...], states: dict[str, TargetState]) -> CopyHealth | None:
    """One copy's health from its addresses' check states; None while all are unknown."""
    known = {a: s for a, s in states.items() if s.health is not TargetHealth.UNKNOWN}
    if not known:
        return None
    up = [a for a in addresses if a in known and known[a].health is TargetHealth.UP]
    failed = tuple(a for a in addresses if a not in up)
    if up:
        return CopyHealth(True, "ok", failed)
    reason = "; ".join(f"{a}: {known[a].detail}" for a in addresses if a in known)
    return CopyHealth(False, f"check failed: {reason}", failed)


class CheckMetrics:
    """Bounded series: per (region, address), never per project or URL.

    At 2,000 projects a per-URL gauge was 4,000 series that every scrape rendered; an
    operator asks "is that region's ingress address up", which this answers.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.targets_by_state = Gauge(
            "region_agent_check_targets_by_state",
            "Checked targets (one per project URL) at one region address, by state",
            ["region", "address", "state"], registry=registry)
        self.results = Counter("region_agent_check_results", "Health check results (ok, fail, local-error)",
                               ["result"], registry=registry)
        self.errors = Counter(
            "region_agent_check_errors",
            "Checks this agent could not make (kind=local: out of descriptors, buffers, memory or ports; "
            "kind=internal: a bug in the check loop); the target keeps its state", ["kind"], registry=registry)
        self.transitions = Counter("region_agent_check_transitions", "Targets changing state", ["to"],
                                   registry=registry)
        self.duration = Histogram("region_agent_check_duration_seconds", "Time one health check took",
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
                                  registry=registry)
        self.targets = Gauge("region_agent_check_targets", "Targets being checked", registry=registry)
        self.last_round = Gauge("region_agent_check_last_success_timestamp_seconds",
                                "Wall time of the last check that got an answer", registry=registry)
        self.reconciles = Counter("region_agent_check_reconciles", "Re-plans of the check targets",
                                  registry=registry)


# A local error keeps the agent degraded this long after the last one (a few check rounds).
LOCAL_ERROR_MEMORY = 30.0


class Checker:
    def __init__(self, store: Store, config: CheckConfig, registry: CollectorRegistry, *,
                 skip_region: str | None = None, only_region: str | None = None,
                 observations: CopySink | None = None) -> None:
        """Checks the copies ``store`` names; what they find goes to ``observations``, never the store."""
        self.store = store
        self.observations = observations if observations is not None else Observations()
        self.config = config
        self.skip_region = skip_region
        self.only_region = only_region
        self.metrics = CheckMetrics(registry)
        self.first_round = asyncio.Event()
        # Set while every target has a known state; cleared when new targets arrive (a store that synced
        # after start brings its projects: their first results are what a returning agent reports).
        self.settled = asyncio.Event()
        self.states: dict[CheckTarget, TargetState] = {}
        self._plan: dict[CheckTarget, set[CopyId]] = {}
        self._region_of: dict[CheckTarget, str] = {}
        self._targets_of: dict[CopyId, list[CheckTarget]] = {}  # the plan inverted: a copy's targets
        self._tasks: dict[CheckTarget, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._pending_reconcile: asyncio.Handle | None = None
        self._slots = asyncio.Semaphore(config.max_concurrent)  # bounded connections and descriptors
        self._counts: dict[tuple[str, str, str], int] = {}  # (region, address, state) -> targets
        self.local_errors = 0
        self.last_local_error: tuple[float, str] | None = None  # (monotonic time, detail)

    def problem(self, now: float | None = None) -> str | None:
        """Why the checker is degraded, or None: a recent check this agent could not make."""
        if self.last_local_error is None:
            return None
        at, detail = self.last_local_error
        if (time.monotonic() if now is None else now) - at > LOCAL_ERROR_MEMORY:
            return None
        return f"checks: {self.local_errors} local error(s), last: {detail}"

    def problems(self) -> tuple[str, ...]:
        problem = self.problem()
        return () if problem is None else (problem,)

    async def run(self) -> None:
        """Check until cancelled; targets follow the store (call :meth:`reconcile`)."""
        self._session = new_session()
        try:
            self.reconcile(self.store)
            await asyncio.Event().wait()
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._pending_reconcile is not None:
                self._pending_reconcile.cancel()
                self._pending_reconcile = None
            # A restarted run plans from scratch; observations stand until a new check says otherwise.
            for region, address, state in list(self._counts):
                with contextlib.suppress(KeyError):
                    self.metrics.targets_by_state.remove(region, address, state)
            self._tasks.clear()
            self.states.clear()
            self._counts.clear()
            self._region_of.clear()
            session, self._session = self._session, None
            await session.close()

    def request_reconcile(self) -> None:
        """Re-plan on the next loop turn: a burst of store changes costs one re-plan."""
        if self._pending_reconcile is None:
            self._pending_reconcile = asyncio.get_running_loop().call_soon(self._reconcile_pending)

    def _reconcile_pending(self) -> None:
        self._pending_reconcile = None
        self.reconcile(self.store)

    def reconcile(self, state: StateView) -> None:
        """Start loops for new targets and stop those no record uses any more."""
        if self._session is None:
            return
        self.metrics.reconciles.inc()
        plan = plan_targets(state, self.config, skip_region=self.skip_region, only_region=self.only_region)
        for target in list(self._tasks):
            if target not in plan:
                self._tasks.pop(target).cancel()
                self._count(target, self.states.pop(target).health, -1)
                self._region_of.pop(target, None)
        for target, copies in plan.items():
            if target not in self._tasks:
                self.states[target] = TargetState()
                self._region_of[target] = next(iter(copies))[1]  # an address belongs to one region
                self._count(target, TargetHealth.UNKNOWN, +1)
                self._tasks[target] = asyncio.get_running_loop().create_task(
                    self._loop(target), name=f"check {target.address} {target.url}")
        self._plan = plan
        before = self._targets_of
        self._targets_of = {}
        for target, copies in plan.items():
            for copy in copies:
                self._targets_of.setdefault(copy, []).append(target)
        self.observations.forget([copy for copy in before if copy not in self._targets_of])
        self.metrics.targets.set(len(plan))
        self._check_first_round()

    def _count(self, target: CheckTarget, health: TargetHealth, delta: int) -> None:
        key = (self._region_of.get(target, ""), target.address, health.value)
        count = self._counts.get(key, 0) + delta
        gauge = self.metrics.targets_by_state
        if count > 0:
            self._counts[key] = count
            gauge.labels(*key).set(count)
        else:
            self._counts.pop(key, None)
            with contextlib.suppress(KeyError):
                gauge.remove(*key)

    async def _loop(self, target: CheckTarget) -> None:
        loop = asyncio.get_running_loop()
        rule = self.config.rule
        while True:
            started = loop.time()
            try:
                delay = await self._check_once(target)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug costs one check, never the target's loop
                logger.exception("check %s %s: internal error", target.address, target.url)
                self.metrics.errors.labels("internal").inc()
                delay = rule.interval
            # A regular check keeps its cadence from the start of the previous one.
            wake = started + delay if delay == rule.interval else loop.time() + delay
            await asyncio.sleep(max(0.0, wake - loop.time()))

    async def _check_once(self, target: CheckTarget) -> float:
        """One probe and its consequences; returns the delay until the next one."""
        assert self._session is not None
        loop = asyncio.get_running_loop()
        rule = self.config.rule
        async with self._slots:  # the probe's own timeout starts once it has a slot
            started = loop.time()
            result = await probe(self._session, target, timeout=self.config.timeout,
                                 expect=self.config.expect, user_agent=self.config.user_agent)
        self.metrics.duration.observe(loop.time() - started)
        self.metrics.results.labels("local-error" if result.outcome is Outcome.LOCAL_ERROR
                                    else "ok" if result.ok else "fail").inc()
        if result.outcome is Outcome.LOCAL_ERROR:
            # This process could not try: nothing was learnt about the target, whose state
            # stays as it was. Retry soon; the agent is degraded meanwhile.
            self.metrics.errors.labels("local").inc()
            self.local_errors += 1
            if self.last_local_error is None or time.monotonic() - self.last_local_error[0] > 1.0:
                logger.error("check %s %s could not be made here: %s", target.address, target.url, result.detail)
            self.last_local_error = (time.monotonic(), result.detail)
            return min(rule.interval, max(rule.recheck_delay, 1.0))
        if result.ok:
            self.metrics.last_round.set(time.time())
        state = self.states[target]
        before = state.health
        delay = state.observe(result.ok, result.detail, rule)
        if state.health is not before:
            self._on_transition(target, before, state)
        return delay

    def _on_transition(self, target: CheckTarget, before: TargetHealth, state: TargetState) -> None:
        self.metrics.transitions.labels(state.health.value).inc()
        self._count(target, before, -1)
        self._count(target, state.health, +1)
        log = logger.warning if state.health is TargetHealth.DOWN else logger.info
        log("check %s %s: %s -> %s (%s)", target.address, target.url, before.value, state.health.value,
            state.detail)
        for slug, region in self._plan.get(target, ()):
            self._publish(slug, region)
        self._check_first_round()

    def _publish(self, slug: str, region_name: str) -> None:
        region = self.store.get(region_key(region_name))
        addresses = region.ipv4 + region.ipv6 if isinstance(region, Region) else ()
        states = {t.address: self.states[t] for t in self._targets_of.get((slug, region_name), ())
                  if t.address in addresses}
        health = copy_health(addresses, states)
        if health is not None:
            self.observations.put((slug, region_name), health)

    def _check_first_round(self) -> None:
        known = all(s.health is not TargetHealth.UNKNOWN for s in self.states.values())
        if known:
            self.settled.set()
        else:
            self.settled.clear()
        if not self.first_round.is_set() and known:
            self.first_round.set()
            logger.info("first health-check round complete: %d targets", len(self.states))
