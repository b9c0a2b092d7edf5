"""The answer-state metrics read what the compiled zone answers: by state, and regions out per project."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from region_agent.globaldns import answer_state
from region_agent.globaldns.answer_state import AnswerStateCollector
from region_agent.globaldns.tables import ZoneTables
from region_agent.state.model import AllDownPolicy, Mode, Project
from tests.globaldns.zones import down, ha, proximity, tables_for, up

# ams1 and nrt1 have IPv4 addresses only (sfo1 has both): no AAAA answer to confuse the A one
V4_HA = Project("failed-over", ("ams1", "nrt1"), primary="ams1", mode=Mode.HA)


def _scrape(tables: ZoneTables | None) -> tuple[dict[str, float], dict[str, float]]:
    registry = CollectorRegistry()
    registry.register(AnswerStateCollector(lambda: tables))
    states, out = {}, {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "region_agent_dns_projects":
                states[sample.labels["answer"]] = sample.value
            elif sample.name == "region_agent_dns_project_regions_out":
                out[sample.labels["project"]] = sample.value
    return states, out


def test_projects_by_answer_state_and_their_regions_out() -> None:
    tables = tables_for(
        [ha("calm"), V4_HA, ha("dark", AllDownPolicy.ALL), ha("refusing", AllDownPolicy.SERVFAIL),
         proximity("near"), proximity("partial")],
        {"calm": up("sfo1", "ams1", "nrt1"),
         "failed-over": {**down("ams1"), **up("nrt1")},
         "dark": down("sfo1", "ams1", "nrt1"),
         "refusing": down("sfo1", "ams1", "nrt1"),
         "near": up("sfo1", "ams1", "nrt1"),
         "partial": {**up("sfo1"), **down("ams1", "nrt1")}},
        health_known=True)
    states, out = _scrape(tables)
    assert set(states) == set(answer_state.STATES)   # every state, 0 included
    assert {k: v for k, v in states.items() if v} == {"primary": 1, "backup": 1, "fallback": 1, "servfail": 1,
                                                      "all-regions": 1, "some-regions": 1}
    assert out == {"failed-over": 1, "dark": 3, "refusing": 3, "partial": 2}


def test_per_project_series_are_bounded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(answer_state, "MAX_PROJECT_SERIES", 3)
    slugs = [f"p{i}" for i in range(10)]
    tables = tables_for([ha(s) for s in slugs], {s: down("ams1") | up("sfo1", "nrt1") for s in slugs},
                        health_known=True)
    states, out = _scrape(tables)
    assert states["primary"] == 10 and sorted(out) == ["p0", "p1", "p2"]
