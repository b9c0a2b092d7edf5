"""Standalone HTTP checks against real endpoints on loopback, writing copy health."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from region_agent.checks.checker import CheckConfig, Checker, copy_health, plan_targets
from region_agent.checks.rule import CheckRule, TargetHealth, TargetState
from region_agent.demo.fake_copy import Behaviour, HealthEndpoint
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, Region, copy_key, project_key, region_key
from region_agent.state.observations import Observations
from region_agent.state.store import Store
from tests.conftest import wait_for


@pytest.fixture
async def endpoints() -> AsyncIterator[tuple[HealthEndpoint, HealthEndpoint, int]]:
    """Two copies' health endpoints on one port, as region ingresses would be."""
    primary = HealthEndpoint("127.0.0.21")
    port = await primary.start()
    backup = HealthEndpoint("127.0.0.22", port)
    await backup.start()
    yield primary, backup, port
    for endpoint in (primary, backup):
        await endpoint.stop()


def _store() -> Store:
    store = Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    store.put(region_key("sfo1"), Region("sfo1", ipv4=("127.0.0.21",)))
    store.put(region_key("ams1"), Region("ams1", ipv4=("127.0.0.22",)))
    store.put(project_key("shop"), Project("shop", ("sfo1", "ams1")))
    return store


def _config(port: int, **rule: float) -> CheckConfig:
    return CheckConfig(port=port, host="runr-health.g.example.com", timeout=0.3,
                       rule=CheckRule(interval=rule.get("interval", 0.5), recheck_delay=rule.get("recheck", 0.05)))


async def _run(checker: Checker) -> asyncio.Task[None]:
    task = asyncio.create_task(checker.run())
    await wait_for(checker.first_round.is_set, timeout=5, message="first round")
    return task


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _observations(checker: Checker) -> Observations:
    assert isinstance(checker.observations, Observations)  # the default sink: this agent's observations
    return checker.observations


def _health(checker: Checker, region: str) -> CopyHealth | None:
    return _observations(checker).get(("shop", region))


async def test_first_round_and_request_shape(endpoints: tuple[HealthEndpoint, HealthEndpoint, int]) -> None:
    primary, _backup, port = endpoints
    store = _store()
    checker = Checker(store, _config(port), CollectorRegistry())
    task = await _run(checker)
    try:
        assert _health(checker, "sfo1") == CopyHealth(True, "ok", ())
        assert _health(checker, "ams1") == CopyHealth(True, "ok", ())
        first = primary.records[0]
        assert first.path == "/global-health/shop"
        assert first.host == f"runr-health.g.example.com:{port}"
    finally:
        await _stop(task)


async def test_a_failure_is_confirmed_by_a_quick_recheck(
    endpoints: tuple[HealthEndpoint, HealthEndpoint, int],
) -> None:
    primary, _backup, port = endpoints
    store = _store()
    checker = Checker(store, _config(port, interval=1.0, recheck=0.05), CollectorRegistry())
    task = await _run(checker)
    try:
        primary.set("down")
        flipped_at = time.time()
        await wait_for(lambda: (h := _health(checker, "sfo1")) is not None and not h.healthy, timeout=3,
                       message="sfo1 down")
        health = _health(checker, "sfo1")
        assert health is not None and "http 503" in health.reason
        times = [r.arrived for r in primary.records if r.arrived >= flipped_at]
        assert len(times) == 2  # the failing regular check and its quick confirmation
        assert times[1] - times[0] < 0.5  # not a whole interval later
    finally:
        await _stop(task)


async def test_one_lost_check_does_not_flip(endpoints: tuple[HealthEndpoint, HealthEndpoint, int]) -> None:
    primary, _backup, port = endpoints
    store = _store()
    checker = Checker(store, _config(port, interval=0.2), CollectorRegistry())
    seen: list[CopyHealth | None] = []
    observations = _observations(checker)
    observations.subscribe(lambda copies: seen.extend(observations.get(c) for c in copies))
    task = await _run(checker)
    try:
        start = len(primary.records)
        primary.once("down")
        await wait_for(lambda: len(primary.records) >= start + 4, timeout=5, message="four more checks")
        assert seen and all(h is not None and h.healthy for h in seen)
        assert store.get(copy_key("shop", "sfo1")) is None  # observations never go into the store
    finally:
        await _stop(task)


@pytest.mark.parametrize(("answer", "delay", "detail"), [
    ((200, "error"), 0.0, "body lacks 'ok'"),
    ((503, "ok"), 0.0, "http 503"),
    ((200, "ok"), 0.6, "timeout"),
])
async def test_what_counts_as_a_failure(endpoints: tuple[HealthEndpoint, HealthEndpoint, int],
                                        answer: tuple[int, str], delay: float, detail: str) -> None:
    primary, _backup, port = endpoints
    primary.set(Behaviour(answer[0], answer[1], delay))
    store = _store()
    checker = Checker(store, _config(port, interval=0.3), CollectorRegistry())
    task = await _run(checker)
    try:
        health = _health(checker, "sfo1")
        assert health is not None and not health.healthy
        assert detail in health.reason
        assert health.failed_addresses == ("127.0.0.21",)
    finally:
        await _stop(task)


async def test_recovery_needs_rise_successes(endpoints: tuple[HealthEndpoint, HealthEndpoint, int]) -> None:
    primary, _backup, port = endpoints
    primary.set("down")
    store = _store()
    checker = Checker(store, _config(port, interval=0.3), CollectorRegistry())
    task = await _run(checker)
    try:
        assert not (_health(checker, "sfo1") or CopyHealth(True)).healthy
        primary.set("200 still ok")  # "ok" as a substring counts, like stringmatch
        await wait_for(lambda: (h := _health(checker, "sfo1")) is not None and h.healthy, timeout=5,
                       message="sfo1 back up")
        target = next(t for t in checker.states if t.address == "127.0.0.21")
        assert checker.states[target].successes >= 2
    finally:
        await _stop(task)


async def test_targets_follow_the_store(endpoints: tuple[HealthEndpoint, HealthEndpoint, int]) -> None:
    _primary, backup, port = endpoints
    store = _store()
    checker = Checker(store, _config(port, interval=0.2), CollectorRegistry())
    store.subscribe(lambda _e: checker.reconcile(store.snapshot()))
    task = await _run(checker)
    try:
        assert len(checker.states) == 2
        store.put(project_key("shop"), Project("shop", ("sfo1",)))
        assert {t.address for t in checker.states} == {"127.0.0.21"}
        count = len(backup.records)
        store.put(project_key("blog"), Project("blog", ("ams1",)))
        await wait_for(lambda: any(r.path == "/global-health/blog" for r in backup.records[count:]), timeout=3,
                       message="blog checked")
    finally:
        await _stop(task)


def test_plan_shares_one_check_per_address_and_url() -> None:
    store = _store()
    store.put(region_key("sfo1"), Region("sfo1", ipv4=("127.0.0.21",), ipv6=("::1",)))
    plan = plan_targets(store.snapshot(), CheckConfig(port=80, host="h"))
    assert {(t.address, t.url) for t in plan} == {
        ("127.0.0.21", "http://h/global-health/shop"), ("::1", "http://h/global-health/shop"),
        ("127.0.0.22", "http://h/global-health/shop"),
    }
    assert next(t for t in plan if t.address == "::1").request_url == "http://[::1]:80/global-health/shop"


def test_copy_health_from_address_states() -> None:
    up, down, unknown = TargetState(TargetHealth.UP), TargetState(TargetHealth.DOWN, detail="http 503"), TargetState()
    assert copy_health(("a", "b"), {"a": unknown, "b": unknown}) is None
    assert copy_health(("a", "b"), {"a": up, "b": down}) == CopyHealth(True, "ok", ("b",))
    assert copy_health(("a", "b"), {"a": up, "b": unknown}) == CopyHealth(True, "ok", ("b",))
    health = copy_health(("a", "b"), {"a": down, "b": down})
    assert health is not None and not health.healthy and health.reason == "check failed: a: http 503; b: http 503"


def test_descriptor_exhaustion_is_a_local_error_and_flips_no_copy() -> None:
    """Out of descriptors says nothing about the remote copy: its state and the zone stay."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "tests.checks.emfile_child"], cwd=root,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["local_errors"] >= 5
    assert result["states"] == ["up", "up", "up"]
    assert result["written"] == [{"key": ["shop", "sfo1"], "healthy": True}]  # one observation, never a flip
    assert "Too many open files" in result["degraded"]


async def test_a_burst_of_store_changes_is_one_replan(endpoints: tuple[HealthEndpoint, HealthEndpoint, int]) -> None:
    _primary, _backup, port = endpoints
    store = _store()
    registry = CollectorRegistry()
    checker = Checker(store, _config(port), registry)
    store.subscribe(lambda _e: checker.request_reconcile())
    task = await _run(checker)
    try:
        before = registry.get_sample_value("region_agent_check_reconciles_total")
        for n in range(50):
            store.put(project_key(f"p{n}"), Project(f"p{n}", ("sfo1",)))
        await wait_for(lambda: len(checker.states) == 52, message="targets of 50 new projects")
        assert registry.get_sample_value("region_agent_check_reconciles_total") == (before or 0) + 1
        await wait_for(lambda: registry.get_sample_value(
            "region_agent_check_targets_by_state",
            {"region": "sfo1", "address": "127.0.0.21", "state": "up"}) == 51, message="51 targets up at sfo1")
        assert registry.get_sample_value("region_agent_check_targets_by_state",
                                         {"region": "sfo1", "address": "127.0.0.21", "state": "unknown"}) is None
    finally:
        await _stop(task)


async def test_checks_in_flight_are_bounded(endpoints: tuple[HealthEndpoint, HealthEndpoint, int]) -> None:
    primary, _backup, port = endpoints
    primary.set("hang 0.05")
    store = _store()
    for n in range(10):
        store.put(project_key(f"p{n}"), Project(f"p{n}", ("sfo1",)))
    config = CheckConfig(port=port, host="h", timeout=1.0, rule=CheckRule(interval=5, recheck_delay=0.05),
                         max_concurrent=2)
    checker = Checker(store, config, CollectorRegistry())
    task = await _run(checker)
    try:
        records = [r for r in primary.records if r.status == 200]
        assert len(records) >= 11  # shop and p0..p9 at 127.0.0.21
        events = sorted([(r.arrived, 1) for r in records] + [(r.finished, -1) for r in records])
        in_flight = peak = 0
        for _time, step in events:
            in_flight += step
            peak = max(peak, in_flight)
        assert peak <= 2
    finally:
        await _stop(task)
