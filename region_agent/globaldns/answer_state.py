"""Which regions each project's answers hold now, as metrics (read from the compiled tables).

Two families, bounded whatever the number of projects:

- ``region_agent_dns_projects{answer}``: projects by the state of their answers — ``primary`` (HA,
  its primary group healthy), ``backup`` (HA, failed over to a backup group), ``all-regions`` /
  ``some-regions`` (proximity: every region, or only some, to choose from), ``fallback`` (none
  healthy: answered by the all-down policy), ``starting`` (first health round), ``servfail``,
  ``nodata``; every state is exported, 0 included;
- ``region_agent_dns_project_regions_out{project}``: for a project with regions that have no healthy
  copy (down, fenced, unknown, not configured), how many; at most :data:`MAX_PROJECT_SERIES`
  projects (the first by name; the counts above hold them all), absent when there are none.

Computed once per compiled zone (the tables are immutable), at the first scrape that sees it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from region_agent.globaldns.tables import ZoneTables

STATES = ("primary", "backup", "all-regions", "some-regions", "fallback", "starting", "servfail", "nodata")
MAX_PROJECT_SERIES = 500


def _family_state(family: Mapping[str, Any], regions: int) -> str:
    """``regions``: how many of the project's regions have an address of this family."""
    if "proximity" in family:   # proximity: the regions it may answer with, by client location
        return "all-regions" if len(family["proximity"]) >= regions else "some-regions"
    outcome, why = family.get("outcome", "nodata"), str(family.get("why", ""))
    if outcome != "answer":
        return str(outcome)
    if why == "primary healthy":
        return "primary"
    if why.startswith("backup group"):
        return "backup"
    if why.startswith("all down"):
        return "fallback"
    return "starting" if why.startswith("first health round") else "all-regions"


def project_state(description: Mapping[str, Any]) -> tuple[str, int]:
    """(the state of the project's answers, how many of its regions have no healthy copy: down, fenced,
    unknown, or not configured). Of A and AAAA the worse state is the project's."""
    targets = description.get("targets") or []
    answers = description.get("answers") or {}
    states = {_family_state(family, _with_family(targets, rdtype == "AAAA"))
              for rdtype, family in answers.items() if family.get("outcome") != "nodata"} or {"nodata"}
    state = max(states, key=_SEVERITY.index)
    return state, sum(1 for t in targets if t.get("health") != "healthy")


def _with_family(targets: list[dict[str, Any]], v6: bool) -> int:
    return sum(1 for t in targets if any((":" in a) == v6 for a in t.get("addresses") or ()))


# From best to worst: a project's state is its worst family's.
_SEVERITY = ("primary", "all-regions", "starting", "backup", "some-regions", "fallback", "nodata", "servfail")


class AnswerStateCollector(Collector):
    def __init__(self, tables: Callable[[], ZoneTables | None]) -> None:
        self._tables = tables
        self._seen: ZoneTables | None = None
        self._counts: Counter[str] = Counter()
        self._out: list[tuple[str, int]] = []

    def _refresh(self, tables: ZoneTables) -> None:
        counts: Counter[str] = Counter()
        out: list[tuple[str, int]] = []
        for slug in sorted(tables.projects):
            state, missing = project_state(tables.projects[slug].description)
            counts[state] += 1
            if missing and len(out) < MAX_PROJECT_SERIES:
                out.append((slug, missing))
        self._seen, self._counts, self._out = tables, counts, out

    def collect(self) -> Iterator[GaugeMetricFamily]:
        tables = self._tables()
        if tables is not None and tables is not self._seen:
            self._refresh(tables)
        by_state = GaugeMetricFamily("region_agent_dns_projects", "Projects by the state of their answers now: "
                                     "primary, backup, all-regions, some-regions, fallback (none healthy), "
                                     "starting, servfail, nodata", labels=["answer"])
        for state in STATES:
            by_state.add_metric([state], self._counts[state])
        yield by_state
        regions_out = GaugeMetricFamily("region_agent_dns_project_regions_out", "Regions of a project with no healthy "
                                        f"copy now (projects with any; at most {MAX_PROJECT_SERIES})",
                                        labels=["project"])
        for slug, missing in self._out:
            regions_out.add_metric([slug], missing)
        yield regions_out

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())
