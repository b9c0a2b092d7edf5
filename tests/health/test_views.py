"""region_agent.health.views as pure tables: view + freshness + request → (status, body, headers)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest

from region_agent.health import views
from region_agent.health.views import IN_PROCESS, Freshness
from region_agent.state.local import BindingStatus, CopyReason, CopyStatus, RegionView
from tests.health.helpers import NOW, REGION, copy, view

RID = "req_sfo1-1800000000000-0123456789ab"
FRESH_SIDECAR = Freshness(sidecar=True, stale=False, age_seconds=0.4, bound_seconds=15.0)
STALE_SIDECAR = Freshness(sidecar=True, stale=True, age_seconds=15.2, bound_seconds=15.0)
NEVER_FED = Freshness(sidecar=True, stale=True, age_seconds=None, bound_seconds=15.0)

ALL_COPIES = [
    copy("ok-copy"),
    copy("norev", CopyReason.NO_READY_REVISION, detail="revision norev-00001 failed: ImagePullBackOff"),
    copy("noroute", CopyReason.ROUTE_NOT_READY, detail="RoutesReady=False"),
    copy("nodata", CopyReason.DATA_NOT_STREAMING, detail="replica nodata-db not streaming"),
    copy("fenced", CopyReason.FENCED),
    copy("gone", CopyReason.NOT_FOUND, detail="Service is being deleted"),
    copy("listing", CopyReason.CACHE_NOT_SYNCED),
]


@dataclass(frozen=True)
class Case:
    name: str
    view: RegionView | None
    slug: str
    status: int
    body: str
    freshness: Freshness = IN_PROCESS


CASES = [
    Case("healthy copy", view(ALL_COPIES), "ok-copy", 200, "ok"),
    Case("no ready revision", view(ALL_COPIES), "norev", 503, "no-ready-revision"),
    Case("route not ready", view(ALL_COPIES), "noroute", 503, "route-not-ready"),
    Case("data not streaming", view(ALL_COPIES), "nodata", 503, "data-not-streaming"),
    Case("fenced", view(ALL_COPIES), "fenced", 503, "fenced"),
    Case("known project without a Service here", view(ALL_COPIES), "gone", 503, "not-found"),
    Case("copy whose data cache is not synced", view(ALL_COPIES), "listing", 503, "cache-not-synced"),
    Case("unknown slug", view(ALL_COPIES), "nobody", 404, "not-found"),
    Case("empty slug", view(ALL_COPIES), "", 404, "not-found"),
    Case("no view yet", None, "ok-copy", 503, "cache-not-synced"),
    Case("first LIST not done", view(ALL_COPIES, synced=False), "ok-copy", 503, "cache-not-synced"),
    Case("not synced beats unknown slug", view(synced=False), "nobody", 503, "cache-not-synced"),
    Case("sidecar, fresh feed", view(ALL_COPIES), "ok-copy", 200, "ok", FRESH_SIDECAR),
    Case("sidecar, fresh feed, unhealthy", view(ALL_COPIES), "norev", 503, "no-ready-revision", FRESH_SIDECAR),
    Case("sidecar, stale feed, healthy copy", view(ALL_COPIES), "ok-copy", 503, "stale", STALE_SIDECAR),
    Case("sidecar, stale feed, unknown slug", view(ALL_COPIES), "nobody", 503, "stale", STALE_SIDECAR),
    Case("sidecar, stale beats not synced", view(synced=False), "x", 503, "stale", STALE_SIDECAR),
    Case("sidecar, never fed", None, "ok-copy", 503, "stale", NEVER_FED),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_global_health_plain_text(case: Case) -> None:
    answer = views.global_health(
        case.view, case.slug, region=REGION, request_id=RID, freshness=case.freshness, want_json=False, now=NOW
    )
    assert (answer.status, answer.body.decode()) == (case.status, case.body)
    assert answer.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert answer.headers["X-Region"] == REGION
    assert answer.headers["X-Request-Id"] == RID
    assert answer.headers["X-Health-Reason"] == case.body
    assert answer.headers["Cache-Control"] == "no-store"
    assert answer.reason == case.body


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_global_health_json_has_the_same_facts(case: Case) -> None:
    answer = views.global_health(
        case.view, case.slug, region=REGION, request_id=RID, freshness=case.freshness, want_json=True, now=NOW
    )
    body = json.loads(answer.body)
    assert answer.status == case.status
    assert answer.headers["Content-Type"] == "application/json"
    assert answer.headers["X-Request-Id"] == RID
    assert body["status"] == case.status
    assert body["reason"] == case.body
    assert body["healthy"] is (case.status == 200)
    assert body["slug"] == case.slug
    assert body["region"] == REGION
    assert body["request_id"] == RID
    assert "detail" not in body  # public: reason codes only
    verbose = views.global_health(
        case.view, case.slug, region=REGION, request_id=RID, freshness=case.freshness, want_json=True, now=NOW,
        verbose=True,
    )
    assert isinstance(json.loads(verbose.body)["detail"], str)


def test_json_carries_the_copy_details_for_operators_only() -> None:
    public = views.global_health(
        view(ALL_COPIES), "norev", region=REGION, request_id=RID, freshness=IN_PROCESS, want_json=True, now=NOW + 2
    )
    assert b"ImagePullBackOff" not in public.body and b"proj-norev" not in public.body
    assert b"norev-00001" not in public.body
    answer = views.global_health(
        view(ALL_COPIES), "norev", region=REGION, request_id=RID, freshness=IN_PROCESS, want_json=True, now=NOW + 2,
        verbose=True,
    )
    body = json.loads(answer.body)
    assert body["detail"] == "revision norev-00001 failed: ImagePullBackOff"
    assert body["namespace"] == "proj-norev"
    assert body["service"] == "norev"
    assert body["view_age_seconds"] == 2.0
    assert body["feed_age_seconds"] is None


def test_json_of_a_stale_answer_says_how_old_the_feed_is() -> None:
    answer = views.global_health(
        view(ALL_COPIES), "ok-copy", region=REGION, request_id=RID, freshness=STALE_SIDECAR, want_json=True, now=NOW,
        verbose=True,
    )
    body = json.loads(answer.body)
    assert body["feed_age_seconds"] == 15.2
    assert "15.2 s" in body["detail"] and "bound 15.0 s" in body["detail"]


def test_an_unhealthy_copy_never_answers_ok_even_with_an_inconsistent_reason() -> None:
    broken = CopyStatus(slug="odd", healthy=False, reason=CopyReason.OK)
    status, reason, _ = views.verdict(view([broken]), "odd", IN_PROCESS)
    assert status == 503
    assert reason is not CopyReason.OK


# --- /health/region ----------------------------------------------------------------------------

LAGGING = BindingStatus("nodata", "proj-nodata", "nodata-db", True, 45.0)
STREAMING = BindingStatus("ok-copy", "proj-ok-copy", "ok-copy-db", True, 0.2)
BROKEN = BindingStatus("nodata", "proj-nodata", "nodata-db2", False, None, "wal receiver down")


@pytest.mark.parametrize(
    ("name", "the_view", "freshness", "reasons"),
    [
        ("healthy", view(ALL_COPIES, bindings=(STREAMING,)), IN_PROCESS, ()),
        ("no view", None, IN_PROCESS, ("cache-not-synced",)),
        ("not synced", view(synced=False), IN_PROCESS, ("cache-not-synced",)),
        ("watch failing", view(watch_errors=("services: 500 from the API",)), IN_PROCESS, ("watch-failing",)),
        ("lag over threshold", view(bindings=(STREAMING, LAGGING)), IN_PROCESS, ("replica-lag",)),
        ("a replica not streaming is the copy's problem", view(bindings=(BROKEN,)), IN_PROCESS, ()),
        ("feed stale", view(), STALE_SIDECAR, ("feed-stale",)),
        ("agent degraded", view(degraded=("checks: local errors (EMFILE)",)), IN_PROCESS, ("agent-degraded",)),
        (
            "everything at once",
            view(synced=False, watch_errors=("x",), bindings=(LAGGING,), degraded=("task x restarting: boom",)),
            STALE_SIDECAR,
            ("feed-stale", "cache-not-synced", "watch-failing", "replica-lag", "agent-degraded"),
        ),
    ],
)
def test_region_degraded_headers(
    name: str, the_view: RegionView | None, freshness: Freshness, reasons: tuple[str, ...]
) -> None:
    answer = views.region_health(
        the_view, region=REGION, request_id=RID, freshness=freshness, now=NOW, lag_threshold_seconds=30.0,
        listener_started_at=NOW - 10,
    )
    body = json.loads(answer.body)
    assert answer.status == 200
    assert answer.headers["X-Region"] == REGION and answer.headers["X-Request-Id"] == RID
    if reasons:
        assert answer.headers["X-Degraded"] == "true"
        assert answer.headers["X-Degraded-Reason"] == ",".join(reasons)
    else:
        assert "X-Degraded" not in answer.headers
        assert "X-Degraded-Reason" not in answer.headers
    assert body["degraded"] is bool(reasons)
    assert body["degraded_reasons"] == list(reasons)


def test_region_body_shape() -> None:
    the_view = view(ALL_COPIES, bindings=(STREAMING, LAGGING), watch_errors=("clusters: timeout",),
                    degraded=("checks: local errors (EMFILE)",))
    answer = views.region_health(
        the_view, region=REGION, request_id=RID, freshness=FRESH_SIDECAR, now=NOW, lag_threshold_seconds=30.0,
        listener_started_at=NOW - 10, verbose=True,
    )
    body = json.loads(answer.body)
    assert body["mode"] == "sidecar"
    assert body["uptime_seconds"] == 100.0
    assert body["listener_uptime_seconds"] == 10.0
    assert body["cache"] == {
        "synced": True, "synced_at": NOW - 90, "synced_age_seconds": 90.0, "last_event_at": NOW - 5,
        "last_event_age_seconds": 5.0, "watch_errors": ["clusters: timeout"],
    }
    assert body["copies"] == {
        "total": 7, "healthy": 1, "unhealthy": 6,
        "by_reason": {
            "cache-not-synced": 1, "data-not-streaming": 1, "fenced": 1, "no-ready-revision": 1,
            "not-found": 1, "route-not-ready": 1,
        },
    }
    assert body["bindings"] == [
        {"slug": "ok-copy", "namespace": "proj-ok-copy", "name": "ok-copy-db", "streaming": True,
         "lag_seconds": 0.2, "detail": "", "lagging": False},
        {"slug": "nodata", "namespace": "proj-nodata", "name": "nodata-db", "streaming": True,
         "lag_seconds": 45.0, "detail": "", "lagging": True},
    ]
    assert body["agent_problems"] == ["checks: local errors (EMFILE)"]
    assert body["zone"] == {"serial": 7, "digest": "abc123"}
    assert body["feed"] == {"age_seconds": 0.4, "stale": False, "stale_after_seconds": 15.0}
    assert body["view"] == {"generated_at": NOW, "age_seconds": 0.0}


def test_region_body_shows_codes_and_counts_publicly() -> None:
    the_view = view(ALL_COPIES, bindings=(STREAMING, LAGGING, BROKEN), watch_errors=("clusters: timeout",),
                    degraded=("checks: local errors (EMFILE)",))
    answer = views.region_health(
        the_view, region=REGION, request_id=RID, freshness=IN_PROCESS, now=NOW, lag_threshold_seconds=30.0,
        listener_started_at=NOW - 10,
    )
    body = json.loads(answer.body)
    assert body["degraded_reasons"] == ["watch-failing", "replica-lag", "agent-degraded"]
    assert answer.headers["X-Degraded-Reason"] == "watch-failing,replica-lag,agent-degraded"
    assert body["cache"]["watch_errors"] == 1
    assert body["bindings"] == {"total": 3, "streaming": 2, "lagging": 1}
    assert "agent_problems" not in body
    for secret in (b"clusters: timeout", b"EMFILE", b"proj-", b"wal receiver", b"nodata-db"):
        assert secret not in answer.body, secret


def test_region_without_a_view() -> None:
    answer = views.region_health(
        None, region=REGION, request_id=RID, freshness=IN_PROCESS, now=NOW, lag_threshold_seconds=30.0,
        listener_started_at=NOW,
    )
    body = json.loads(answer.body)
    assert body["mode"] == "in-process" and body["feed"] is None
    assert body["uptime_seconds"] is None
    assert body["copies"]["total"] == 0
    assert body["cache"]["synced"] is False


# --- probes and errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("the_view", "freshness", "status", "body"),
    [
        (view(), IN_PROCESS, 200, "ready"),
        (None, IN_PROCESS, 503, "not ready: cache-not-synced"),
        (view(synced=False), IN_PROCESS, 503, "not ready: cache-not-synced"),
        (view(), FRESH_SIDECAR, 200, "ready"),
        (view(), STALE_SIDECAR, 503, "not ready: stale"),
        (None, NEVER_FED, 503, "not ready: stale"),
    ],
)
def test_readiness(the_view: RegionView | None, freshness: Freshness, status: int, body: str) -> None:
    answer = views.readiness(the_view, freshness, region=REGION, request_id=RID)
    assert (answer.status, answer.body.decode()) == (status, body)
    assert answer.headers["X-Request-Id"] == RID


def test_liveness_and_errors_carry_region_and_request_id() -> None:
    for answer, status in [
        (views.liveness(region=REGION, request_id=RID), 200),
        (views.not_found(region=REGION, request_id=RID), 404),
        (views.method_not_allowed(region=REGION, request_id=RID), 405),
        (views.server_error(region=REGION, request_id=RID), 500),
        (views.metrics(b"# x\n", "text/plain", region=REGION, request_id=RID), 200),
    ]:
        assert answer.status == status
        assert answer.headers["X-Region"] == REGION
        assert answer.headers["X-Request-Id"] == RID
    assert views.method_not_allowed(region=REGION, request_id=RID).headers["Allow"] == "GET, HEAD"


def test_counts() -> None:
    counts = views.count_copies(view(ALL_COPIES))
    assert (counts.total, counts.healthy, counts.unhealthy) == (7, 1, 6)
    assert views.count_copies(None).total == 0


def test_cluster_verdicts_show_status_to_everyone_and_reasons_to_operators() -> None:
    cluster = {"majority": True, "regions": {
        "ams1": {"status": "out", "in_answers": False, "reason": "silent: 2 of 2 vantage points agree"},
        "sfo1": {"status": "up", "in_answers": True, "reason": "alive"}}}
    the_view = dataclasses.replace(view(ALL_COPIES), members={"sfo1": 2}, cluster=cluster)
    shown = {}
    for verbose in (False, True):
        answer = views.region_health(the_view, region=REGION, request_id=RID, freshness=FRESH_SIDECAR, now=NOW,
                                     lag_threshold_seconds=30.0, listener_started_at=NOW - 10, verbose=verbose)
        shown[verbose] = json.loads(answer.body)
    assert shown[False]["cluster"] == {"majority": True, "regions": {
        "ams1": {"status": "out", "in_answers": False}, "sfo1": {"status": "up", "in_answers": True}}}
    assert shown[True]["cluster"] == cluster and shown[True]["members"] == {"sfo1": 2}
    assert RegionView.from_dict(the_view.to_dict()).cluster == cluster   # it crosses to the sidecar intact
