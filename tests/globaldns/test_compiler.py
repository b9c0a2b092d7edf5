"""Incremental compilation gives exactly the zone a full compilation gives."""

from __future__ import annotations

import random
import time

from prometheus_client import CollectorRegistry

from region_agent.globaldns.compiler import ZoneConfig, compile_zone
from region_agent.globaldns.service import ZoneService
from region_agent.globaldns.settings import DnsSettings
from region_agent.globaldns.tables import ZoneTables
from region_agent.state.hlc import HybridClock
from region_agent.state.model import AllDownPolicy, CopyHealth, Mode, Project, Region, copy_key, project_key, region_key
from region_agent.state.store import Store

REGIONS = ("sfo1", "ams1", "nrt1", "iad1")
CONFIG = ZoneConfig("g.example.com")


def _canonical(tables: ZoneTables) -> dict[bytes, object]:
    return {owner: (sorted(node.replies.items()), sorted((q, sorted(p.by_region.items()), p.candidates, p.unlocated)
                                                         for q, p in node.dynamic.items()), node.any_reply)
            for owner, node in tables.nodes.items()}


async def test_the_service_compiles_incrementally_what_a_full_compile_gives() -> None:
    """Random changes through the store: the zone service's tables (incremental, sliced) equal a full compile."""
    rng = random.Random(11)
    store = Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    for i, name in enumerate(REGIONS):
        store.put(region_key(name), Region(name, ipv4=(f"192.0.2.{i + 1}",), ns_ipv4=(f"192.0.2.{i + 50}",)))
    service = ZoneService(DnsSettings(zone=CONFIG.apex, listen_addresses=("127.0.0.1",), port=0), store,
                          CollectorRegistry())
    service.set_health_known()  # answers follow health, as after the first check round
    service.rebuild()  # what start() does before the sockets open
    for step in range(300):
        slug = f"p{rng.randrange(12)}"
        action = rng.random()
        if action < 0.5:
            store.put(copy_key(slug, rng.choice(REGIONS)), CopyHealth(rng.random() < 0.6, "x"))
        elif action < 0.8:
            regions = tuple(rng.sample(REGIONS, rng.randrange(1, 5)))
            store.put(project_key(slug), Project(slug, regions, mode=rng.choice(list(Mode)),
                                                 all_down=rng.choice(list(AllDownPolicy))))
        elif action < 0.95:
            store.delete(project_key(slug))
        else:
            name = rng.choice(REGIONS)
            store.put(region_key(name), Region(name, ipv4=(f"198.51.100.{step % 250 + 1}",)))
        await service.compiled()
        served = service.tables
        assert served is not None
        full = compile_zone(store, CONFIG)
        assert _canonical(served) == _canonical(full), f"step {step}"
        assert served.description == full.description
        assert served.serial == full.serial


def test_a_health_flip_reuses_every_other_project() -> None:
    store = Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    store.put(region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",)))
    for n in range(50):
        store.put(project_key(f"p{n}"), Project(f"p{n}", ("sfo1",)))
    first = compile_zone(store, CONFIG)
    store.put(copy_key("p7", "sfo1"), CopyHealth(True))
    second = compile_zone(store, CONFIG, previous=first, changed_projects={"p7"})
    reused = [slug for slug in first.projects if second.projects[slug] is first.projects[slug]]
    assert len(reused) == 49 and "p7" not in reused
