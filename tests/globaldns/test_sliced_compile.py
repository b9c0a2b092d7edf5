"""Compilation in slices: the same zone as in one go, the previous tables answered meanwhile."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
from prometheus_client import CollectorRegistry

from region_agent.base.gc_pause import gc_paused
from region_agent.globaldns import service as zone_service
from region_agent.globaldns.compiler import ZoneBuild, ZoneConfig, compile_zone
from region_agent.globaldns.service import ZoneService
from region_agent.globaldns.settings import DnsSettings
from region_agent.state.hlc import HybridClock
from region_agent.state.model import Project, Region, project_key, region_key
from region_agent.state.store import Store
from tests.globaldns.test_compiler import _canonical

CONFIG = ZoneConfig("g.example.com")


def _store(projects: int) -> Store:
    store = Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    store.put_many([(region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",), ns_ipv4=("192.0.2.53",))),
                    (region_key("ams1"), Region("ams1", ipv4=("192.0.2.2",)))])
    store.put_many([(project_key(f"p{n}"), Project(f"p{n}", ("sfo1", "ams1"))) for n in range(projects)])
    return store


def test_a_build_in_slices_equals_one_in_a_go() -> None:
    store = _store(200)
    build = ZoneBuild(store, CONFIG)
    steps = 1
    while not build.step(0.0):  # a zero budget: one small slice per step
        steps += 1
    sliced = build.finish()
    assert steps > 5 and build.compiled == 200
    assert _canonical(sliced) == _canonical(compile_zone(store, CONFIG))


async def test_the_service_answers_the_previous_tables_until_the_sliced_compile_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zone_service, "COMPILE_SLICE_SECONDS", 0.0)
    store = _store(300)
    service = ZoneService(DnsSettings(zone="g.example.com", listen_addresses=("127.0.0.1",), port=0), store,
                          CollectorRegistry())
    service.rebuild()
    before = service.tables
    assert before is not None
    store.put(region_key("ams1"), Region("ams1", ipv4=("192.0.2.22",)))  # every project compiles again
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert service.tables is before  # mid-compile: the old zone is what answers
    store.put(project_key("late"), Project("late", ("ams1",)))  # a change while compiling
    await service.compiled()
    after = service.tables
    assert after is not before and after is not None
    assert _canonical(after) == _canonical(compile_zone(store, CONFIG))
    assert "late" in after.projects
    await service.stop()


def test_gc_pause_nests_and_restores() -> None:
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
