"""The operator listener's ``/status.json``: what the status page (``/status``) shows, in one document.

Regions with the cluster's verdicts, members with state and round trip, whether every agent
holds this agent's store digest, each project with the regions in its answers now and why the
others are not, and the recent transitions (:mod:`region_agent.app.events`).

Bounded work per request: the document's generation is a time bucket of
:data:`RENDER_INTERVAL` seconds, so however many pages poll, it is rendered at most once per
bucket (:class:`~region_agent.health.operator.DocumentCache` serves the bytes meanwhile). Projects are
summarized once per compiled project (the compiler keeps a project's object while it is
unchanged, so a new zone re-summarizes only what changed); at most :data:`MAX_PROJECTS` are
listed — those with a region down, fenced or not reported first (a healthy standby of an HA
project is no trouble), then by name — with counts over all.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from region_agent.app.events import EventRing
from region_agent.globaldns.answer_state import STATES, project_state
from region_agent.globaldns.service import ZoneService
from region_agent.globaldns.tables import CompiledProject, ZoneTables
from region_agent.state.store import Store

if TYPE_CHECKING:
    from region_agent.app.cluster import ClusterParts

__all__ = ["MAX_PROJECTS", "RENDER_INTERVAL", "StatusDocument", "summarize_project"]

MAX_PROJECTS = 200
RENDER_INTERVAL = 0.5   # seconds: the page polls every second, a change shows within one bucket more


def summarize_project(slug: str, description: Mapping[str, Any]) -> dict[str, Any]:
    """One project as the page lists it: the regions its answers hold now and why each other one is not."""
    state, _missing = project_state(description)
    targets = description.get("targets") or []
    answered: set[str] = set()
    proximity: set[str] = set()
    whys: list[str] = []
    for family in (description.get("answers") or {}).values():
        if "proximity" in family:
            proximity.update(family["proximity"])
        elif family.get("outcome") != "nodata":   # a family without addresses explains nothing
            answered.update(family.get("addresses") or ())
            why = str(family.get("why") or "")
            if why and why not in whys:
                whys.append(why)
    in_answers: list[str] = []
    out: list[dict[str, Any]] = []
    for target in targets:
        region = str(target.get("region"))
        addresses = target.get("addresses") or []
        if region in proximity or any(a in answered for a in addresses):
            in_answers.append(region)
            continue
        health = target.get("health")
        reason = str(target.get("reason") or "")
        standby = False
        if health == "fenced":
            why = "region fenced"
        elif not addresses:
            why = "region not configured (no addresses)"
        elif health == "unknown":
            why = "no health report yet"
        elif health == "unhealthy":
            why = f"unhealthy: {reason}" if reason else "unhealthy"
        else:
            standby = True
            why = f"healthy, not chosen ({'; '.join(whys) or 'no answer of its family'})"
        out.append({"region": region, "why": why, "standby": standby})
    return {"slug": slug, "mode": description.get("mode"), "state": state, "why": "; ".join(whys),
            "in_answers": in_answers, "out": out, "trouble": any(not o["standby"] for o in out)}


class _Projects:
    """Project rows and counts, per zone tables; a compiled project is summarized once while it lives."""

    def __init__(self) -> None:
        self._tables: ZoneTables | None = None
        self._rows: dict[int, tuple[CompiledProject, dict[str, Any]]] = {}
        self._listed: list[dict[str, Any]] = []
        self._summary: dict[str, Any] = self._counts(0, Counter(), 0)

    def get(self, tables: ZoneTables | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if tables is None:
            return [], self._counts(0, Counter(), 0)
        if tables is not self._tables:
            self._refresh(tables)
        return self._listed, self._summary

    def _refresh(self, tables: ZoneTables) -> None:
        known, kept = self._rows, {}
        states: Counter[str] = Counter()
        troubled: list[dict[str, Any]] = []
        fine: list[dict[str, Any]] = []
        for slug in sorted(tables.projects):
            compiled = tables.projects[slug]
            hit = known.get(id(compiled))
            if hit is None or hit[0] is not compiled:
                hit = (compiled, summarize_project(slug, compiled.description))
            kept[id(compiled)] = hit
            row = hit[1]
            states[row["state"]] += 1
            (troubled if row["trouble"] else fine).append(row)
        self._rows = kept
        self._listed = (troubled + fine[:max(0, MAX_PROJECTS - len(troubled))])[:MAX_PROJECTS]
        self._summary = self._counts(len(tables.projects), states, len(troubled))
        self._tables = tables

    @staticmethod
    def _counts(total: int, states: Counter[str], troubled: int) -> dict[str, Any]:
        return {"total": total, "limit": MAX_PROJECTS, "shown": min(total, MAX_PROJECTS),
                "with_regions_down": troubled, "by_state": {state: states[state] for state in STATES},
                "order": "projects with a region down, fenced or not reported first, then by name"}


class StatusDocument:
    def __init__(self, *, region: str, node: str, zone: str, store: Store, dns: ZoneService, events: EventRing,
                 ready: asyncio.Event, cluster: Callable[[], ClusterParts | None],
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.region = region
        self.node = node
        self.zone = zone
        self.store = store
        self.dns = dns
        self.events = events
        self.ready = ready
        self._cluster = cluster
        self._monotonic = monotonic
        self._projects = _Projects()

    def generation(self) -> int:
        """A time bucket: rendered at most once per :data:`RENDER_INTERVAL`, whatever changes or asks."""
        return int(self._monotonic() / RENDER_INTERVAL)

    def describe(self) -> dict[str, Any]:
        tables = self.dns.tables
        cluster = self._cluster()
        digest = self.store.digest()
        projects, summary = self._projects.get(tables)
        return {
            "region": self.region, "node": self.node, "zone": self.zone, "generated_at": time.time(),
            "render_interval_seconds": RENDER_INTERVAL, "ready": self.ready.is_set(),
            "serial": None if tables is None else tables.serial,
            "majority": None if cluster is None else cluster.answers.majority,
            "regions": self._regions(cluster),
            "members": [] if cluster is None else self._members(cluster),
            "digests": self._digests(cluster, digest),
            "projects_summary": summary,
            "projects": projects,
            "events_summary": {"capacity": self.events.capacity, "total": self.events.total},
            "events": [event.to_dict() for event in self.events.recent()],
        }

    def _regions(self, cluster: ClusterParts | None) -> list[dict[str, Any]]:
        verdicts: Mapping[str, Any] = {} if cluster is None else cluster.answers.verdicts
        out: Mapping[str, str] = {} if cluster is None else cluster.answers.out
        live = {} if cluster is None else cluster.members_by_region()
        fenced = self.store.fenced
        rows = []
        for name in sorted(set(self.store.regions) | set(verdicts) | set(fenced)):
            verdict = verdicts.get(name)
            if verdict is None:
                status, reason = ("fenced", fenced[name].reason) if name in fenced else ("unjudged", "")
                inside = name not in fenced
            else:
                status, reason, inside = verdict.status.value, verdict.reason, name not in out
            rows.append({"name": name, "status": status, "in_answers": inside, "reason": reason,
                         "members_live": live.get(name, 0), "fenced": name in fenced,
                         "configured": name in self.store.regions})
        return rows

    @staticmethod
    def _members(cluster: ClusterParts) -> list[dict[str, Any]]:
        return [{"name": row.name, "region": row.region, "node": row.node, "role": row.role, "state": row.state,
                 "since": row.since, "rtt_ms": None if row.rtt is None else round(row.rtt * 1000, 3)}
                for row in cluster.member_rows()]

    def _digests(self, cluster: ClusterParts | None, local: str) -> dict[str, Any]:
        agents = [] if cluster is None else sorted(cluster.peer_digests().items())
        return {"local": local, "converged": all(digest == local for _, digest in agents),
                "agents": [{"member": name, "digest": digest, "same": digest == local} for name, digest in agents]}
