"""/status.json (region_agent.app.status) and the ring of recent transitions (region_agent.app.events).

What each project's row says about the regions in and out of its answers; bounded work with
10,000 projects (a capped list, counts over all, one render per interval whatever polls); the
events fed from the store, the verdicts and the membership, and the ring's bound.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, cast

from region_agent.app.events import CAPACITY, COPIES_PER_BATCH, EventFeed, EventRing
from region_agent.app.status import MAX_PROJECTS, RENDER_INTERVAL, StatusDocument, summarize_project
from region_agent.cluster.quorum import Policy, Status, Verdict
from region_agent.globaldns.answer_state import STATES
from region_agent.globaldns.tables import ZoneTables
from region_agent.gossip.messages import State
from region_agent.health.operator import Document, DocumentCache
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Fence, Mode, Project, copy_key, fence_key
from region_agent.state.store import Store
from tests.globaldns.zones import down, ha, proximity, tables_for, up

V4_HA = Project("failed", ("ams1", "nrt1"), primary="ams1", mode=Mode.HA)   # IPv4 only: no AAAA to confuse A


def _rows(tables: ZoneTables) -> dict[str, dict[str, Any]]:
    return {slug: summarize_project(slug, p.description) for slug, p in tables.projects.items()}


def test_each_project_says_which_regions_its_answers_hold_and_why_not_the_others() -> None:
    rows = _rows(tables_for(
        [ha("calm"), V4_HA, proximity("partial"), proximity("unknown")],
        {"calm": up("sfo1", "ams1", "nrt1"), "failed": {**down("ams1"), **up("nrt1")},
         "partial": {**up("sfo1"), **down("ams1", "nrt1")}, "unknown": up("sfo1")}, health_known=True))
    calm = rows["calm"]
    assert calm["state"] == "primary" and calm["in_answers"] == ["sfo1"]
    assert calm["out"] == [{"region": "ams1", "why": "healthy, not chosen (primary healthy)", "standby": True},
                           {"region": "nrt1", "why": "healthy, not chosen (primary healthy)", "standby": True}]
    assert not calm["trouble"]   # a healthy standby is no trouble
    failed = rows["failed"]
    assert failed["state"] == "backup" and failed["in_answers"] == ["nrt1"] and failed["trouble"]
    assert failed["out"] == [{"region": "ams1", "why": "unhealthy: down", "standby": False}]
    partial = rows["partial"]
    assert partial["state"] == "some-regions" and partial["in_answers"] == ["sfo1"]
    assert [o["why"] for o in partial["out"]] == ["unhealthy: down", "unhealthy: down"]
    assert {o["region"]: o["why"] for o in rows["unknown"]["out"]} == {"ams1": "no health report yet",
                                                                      "nrt1": "no health report yet"}


def _document(tables: ZoneTables | None, now: list[float], events: EventRing | None = None) -> StatusDocument:
    store = Store(writer="standalone/test", clock=HybridClock(lambda: int(time.time() * 1000)))
    return StatusDocument(region="sfo1", node="n0", zone="g.example.com", store=store,
                          dns=cast(Any, SimpleNamespace(tables=tables)), events=events or EventRing(),
                          ready=asyncio.Event(), cluster=lambda: None, monotonic=lambda: now[0])


async def test_ten_thousand_projects_cost_one_render_per_interval_and_list_at_most_the_cap() -> None:
    slugs = [f"p{i:05d}" for i in range(10_000)]
    troubled = {f"p{i:05d}" for i in range(9_990, 10_000)}   # last by name, listed first
    tables = tables_for([ha(s) for s in slugs],
                        {s: ({**down("ams1"), **up("sfo1", "nrt1")} if s in troubled else up("sfo1", "ams1", "nrt1"))
                         for s in slugs}, health_known=True)
    now = [1000.0]
    document = _document(tables, now)
    cache = DocumentCache(Document(document.describe, document.generation))
    first = await cache.get()
    started = time.perf_counter()
    for _ in range(200):   # a page polling, many pages: the same bytes within one interval
        assert await cache.get() is first
    assert cache.renders == 1 and time.perf_counter() - started < 0.5
    now[0] += RENDER_INTERVAL
    described = document.describe()
    listed = [row["slug"] for row in described["projects"]]
    assert len(listed) == MAX_PROJECTS and listed[:10] == sorted(troubled) and listed[10] == "p00000"
    assert described["projects_summary"] == {
        "total": 10_000, "limit": MAX_PROJECTS, "shown": MAX_PROJECTS, "with_regions_down": 10,
        "by_state": {**dict.fromkeys(STATES, 0), "primary": 10_000},
        "order": "projects with a region down, fenced or not reported first, then by name"}
    # Same tables: the rows are the same objects (the cache reuses their encoding), and cheap to list again.
    started = time.perf_counter()
    again = document.describe()
    assert time.perf_counter() - started < 0.05
    assert all(a is b for a, b in zip(again["projects"], described["projects"], strict=True))
    await cache.get()
    assert cache.renders == 2


async def test_standalone_has_no_members_and_regions_unjudged() -> None:
    tables = tables_for([ha("calm")], {"calm": up("sfo1", "ams1", "nrt1")}, health_known=True)
    document = _document(tables, [0.0])
    document.store.put(fence_key("nrt1"), Fence("nrt1", "maintenance"))
    described = document.describe()
    assert described["majority"] is None and described["members"] == []
    assert described["digests"] == {"local": document.store.digest(), "converged": True, "agents": []}
    assert [(r["name"], r["status"], r["in_answers"]) for r in described["regions"]] == [("nrt1", "fenced", False)]


def test_the_ring_keeps_the_newest_and_counts_all() -> None:
    ring = EventRing()
    for i in range(250):
        ring.add("copy-up", f"s{i}", f"event {i}")
    recent = ring.recent()
    assert len(recent) == CAPACITY == ring.capacity and ring.total == 250
    assert recent[0].text == "event 249" and recent[-1].text == "event 150"


def test_store_changes_become_fence_and_copy_events_bounded_per_batch() -> None:
    ring = EventRing()
    feed = EventFeed(ring)
    store = Store(writer="standalone/test", clock=HybridClock(lambda: int(time.time() * 1000)))
    store.subscribe(feed.store_changed)
    store.put(fence_key("fra1"), Fence("fra1", "drill"))
    store.put_many([(fence_key("fra1"), None)])
    store.put_many([(copy_key(f"p{i}", "sfo1"), CopyHealth(False, "check failed: http 503")) for i in range(20)])
    store.put(copy_key("p0", "sfo1"), CopyHealth(True))
    texts = [e.text for e in reversed(ring.recent())]
    assert texts[:2] == ["region fra1 fenced: drill", "region fra1 unfenced"]
    assert texts[2:2 + COPIES_PER_BATCH] == [f"copy p{i}/sfo1 unhealthy: check failed: http 503"
                                             for i in range(COPIES_PER_BATCH)]
    assert texts[2 + COPIES_PER_BATCH:] == [f"{20 - COPIES_PER_BATCH} more copy health changes in the same batch",
                                            "copy p0/sfo1 healthy"]


def test_verdicts_and_members_become_events_only_when_they_change() -> None:
    ring = EventRing()
    feed = EventFeed(ring)
    answers = SimpleNamespace(majority=True, policy=Policy.HOLD,
                              verdicts={"sfo1": Verdict("sfo1", Status.UP, "ingress up"),
                                        "fra1": Verdict("fra1", Status.UP, "ingress up")})
    feed.verdicts_changed(cast(Any, answers))
    assert ring.total == 0   # everything up at the start is no transition
    answers.verdicts = {**answers.verdicts, "fra1": Verdict("fra1", Status.OUT, "ingress down (2 of 2)")}
    answers.majority = False
    feed.verdicts_changed(cast(Any, answers))
    feed.verdicts_changed(cast(Any, answers))   # nothing new
    assert [(e.kind, e.text) for e in reversed(ring.recent())] == [
        ("majority-lost", "this agent no longer sees a majority of regions: writes refused, nobody removed"),
        ("region-out", "region fra1 out (was up), out of the answers: ingress down (2 of 2)")]
    member = SimpleNamespace(name="fra1/n2", region="fra1")
    feed.member_changed(cast(Any, SimpleNamespace(member=member, state=State.SUSPECT)), State.ALIVE)
    feed.member_changed(cast(Any, SimpleNamespace(member=member, state=State.SUSPECT)), State.SUSPECT)  # a refresh
    feed.member_changed(cast(Any, SimpleNamespace(member=member, state=State.DEAD)), State.SUSPECT)
    assert [(e.kind, e.text) for e in ring.recent()[:2]] == [
        ("member-lost", "member fra1/n2 (fra1) suspect -> dead"),
        ("member-suspect", "member fra1/n2 (fra1) alive -> suspect")]
