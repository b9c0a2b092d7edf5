"""A project naming a region that is not configured is a problem, not a silent NODATA."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from region_agent.app.consistency import MissingRegions
from region_agent.state.hlc import HybridClock
from region_agent.state.model import Project, Region, project_key, region_key
from region_agent.state.store import Store


def test_a_region_deleted_under_a_project_shows_until_it_is_back() -> None:
    store = Store(writer="control/sfo1.n1", clock=HybridClock(lambda: int(time.time() * 1000)))
    store.put_many([(region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",))),
                    (region_key("ams1"), Region("ams1", ipv4=("192.0.2.2",))),
                    (project_key("shop"), Project("shop", ("sfo1", "ams1"))),
                    (project_key("blog"), Project("blog", ("sfo1",)))])
    registry = CollectorRegistry()
    rule = MissingRegions(store, registry)
    assert rule.problems() == ()
    store.delete(region_key("ams1"))   # at another agent, say: the API there checked only that agent's view
    assert rule.problems() == ("project shop names region(s) ams1 that are not configured: left out of its answers",)
    assert registry.get_sample_value("region_agent_state_projects_missing_regions") == 1
    store.put(project_key("blog"), Project("blog", ("nrt1",)))   # arrives by gossip before its region
    assert len(rule.problems()) == 2
    store.put_many([(region_key("ams1"), Region("ams1")), (region_key("nrt1"), Region("nrt1"))])
    assert rule.problems() == () and registry.get_sample_value("region_agent_state_projects_missing_regions") == 0
