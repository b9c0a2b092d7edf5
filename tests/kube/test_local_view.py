"""Combining the caches into this region's copies and bindings (pure)."""

from __future__ import annotations

from region_agent.kube.local_view import build_local_view
from region_agent.kube.models import CnpgCluster, KnativeService
from region_agent.state.local import BindingStatus, CopyReason
from tests.fakes.kube_objects import PROJECT_LABEL, cnpg_cluster, knative_service

LABEL = PROJECT_LABEL


def services(*raws: dict[str, object]) -> dict[str, KnativeService]:
    records = [KnativeService.from_api(raw, keep_labels=(LABEL,)) for raw in raws]
    return {f"{r.namespace}/{r.name}": r for r in records}


def clusters(*raws: dict[str, object]) -> dict[str, CnpgCluster]:
    records = [CnpgCluster.from_api(raw, keep_labels=(LABEL,)) for raw in raws]
    return {f"{r.namespace}/{r.name}": r for r in records}


def test_nothing_is_known_before_the_service_cache_syncs() -> None:
    view = build_local_view(services=services(knative_service("shop")), services_synced=False, slug_label=LABEL)
    assert view.copies == {} and view.bindings == ()


def test_copies_by_slug_without_cnpg() -> None:
    view = build_local_view(
        services=services(knative_service("shop-eu", slug="shop"), knative_service("blog", traffic=[])),
        services_synced=True,
        slug_label=LABEL,
    )
    assert set(view.copies) == {"shop", "blog"}
    assert view.copies["shop"].healthy and view.copies["shop"].service == "shop-eu"
    assert view.copies["blog"].reason is CopyReason.ROUTE_NOT_READY


def test_a_healthy_service_wins_when_two_carry_the_same_slug() -> None:
    view = build_local_view(
        services=services(
            knative_service("a", namespace="one", slug="shop", traffic=[]),
            knative_service("b", namespace="two", slug="shop"),
        ),
        services_synced=True,
        slug_label=LABEL,
    )
    assert view.copies["shop"].healthy and view.copies["shop"].namespace == "two"


def test_every_copy_waits_for_the_cluster_cache() -> None:
    view = build_local_view(
        services=services(knative_service("shop")),
        services_synced=True,
        slug_label=LABEL,
        clusters={},
        clusters_synced=False,
        binding_label=LABEL,
    )
    assert view.copies["shop"].reason is CopyReason.CACHE_NOT_SYNCED


def test_bindings_join_copies_by_slug() -> None:
    statuses = {
        "projects/shop-db": BindingStatus("shop", "projects", "shop-db", False, None, "WAL receiver not active"),
        "projects/blog-db": BindingStatus("blog", "projects", "blog-db", True, 0.1, "streaming"),
    }
    view = build_local_view(
        services=services(knative_service("shop"), knative_service("blog"), knative_service("wiki")),
        services_synced=True,
        slug_label=LABEL,
        clusters=clusters(
            cnpg_cluster("shop-db", slug="shop"),
            cnpg_cluster("blog-db", slug="blog"),
            cnpg_cluster("wiki-db", slug="wiki"),
            cnpg_cluster("unbound"),
        ),
        binding_statuses=statuses,
        binding_label=LABEL,
    )
    assert view.copies["shop"].reason is CopyReason.DATA_NOT_STREAMING
    assert "WAL receiver" in view.copies["shop"].detail
    assert view.copies["blog"].healthy
    assert view.copies["wiki"].reason is CopyReason.DATA_NOT_STREAMING  # bound but not polled yet
    assert [b.name for b in view.bindings] == ["blog-db", "shop-db", "wiki-db"]
    assert view.bindings[2].detail == "instance status not polled yet"


def test_remembered_verdicts_give_the_same_answers_and_follow_changes() -> None:
    from region_agent.kube.local_view import ServiceVerdicts

    verdicts = ServiceVerdicts()
    current = services(
        knative_service("shop"),
        knative_service("blog"),
        knative_service("a", namespace="one", slug="wiki", traffic=[]),
        knative_service("b", namespace="two", slug="wiki"),
    )
    first = build_local_view(services=current, services_synced=True, slug_label=LABEL, verdicts=verdicts)
    assert first == build_local_view(services=current, services_synced=True, slug_label=LABEL)
    assert first.copies["wiki"].namespace == "two"

    current = dict(current)
    current.update(services(knative_service("shop", traffic=[])))  # a new record object for shop
    del current["projects/blog"]
    second = build_local_view(services=current, services_synced=True, slug_label=LABEL, verdicts=verdicts)
    assert second == build_local_view(services=current, services_synced=True, slug_label=LABEL)
    assert second.copies["shop"].reason is CopyReason.ROUTE_NOT_READY and "blog" not in second.copies
