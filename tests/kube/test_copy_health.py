"""Copy health rules (PLATFORM.md §1.3) as a table over realistic Knative Service states."""

from __future__ import annotations

from typing import Any

import pytest

from region_agent.kube.copy_health import copy_status, not_synced_status, service_status, slug_of
from region_agent.kube.models import KnativeService
from region_agent.state.local import BindingStatus, CopyReason
from tests.fakes.kube_objects import PROJECT_LABEL, knative_service


def record(raw: dict[str, Any]) -> KnativeService:
    return KnativeService.from_api(raw, keep_labels=(PROJECT_LABEL,))


CASES = {
    "rolled out": (knative_service("shop"), True, CopyReason.OK, ("shop-00001",)),
    "scaled to zero (Ready stays True, traffic stays assigned)": (
        knative_service("shop"),
        True,
        CopyReason.OK,
        ("shop-00001",),
    ),
    "new revision failed, old one serving": (
        knative_service(
            "shop",
            generation=2,
            observed_generation=2,
            latest_created="shop-00002",
            ready="False",
            configurations_ready="False",
            configurations_reason="RevisionFailed",
            configurations_message='Revision "shop-00002" failed with message: exit 1.',
        ),
        True,
        CopyReason.OK,
        ("shop-00001",),
    ),
    "rollout in progress": (
        knative_service(
            "shop",
            generation=2,
            observed_generation=1,
            latest_created="shop-00002",
            ready="Unknown",
            configurations_ready="Unknown",
            routes_ready="Unknown",
            routes_reason="TrafficNotMigrated",
        ),
        True,
        CopyReason.OK,
        ("shop-00001",),
    ),
    "traffic split, one at zero percent": (
        knative_service("shop", traffic=[("shop-00001", 100), ("shop-00002", 0)]),
        True,
        CopyReason.OK,
        ("shop-00001",),
    ),
    "first revision failed": (
        knative_service(
            "shop",
            latest_ready=None,
            latest_created="shop-00001",
            ready="False",
            configurations_ready="False",
            configurations_reason="RevisionFailed",
            routes_ready="False",
            routes_reason="RevisionMissing",
            routes_message='Configuration "shop" does not have any ready Revision.',
        ),
        False,
        CopyReason.NO_READY_REVISION,
        (),
    ),
    "brand new, nothing ready yet": (
        knative_service(
            "shop",
            latest_ready=None,
            latest_created="shop-00001",
            observed_generation=None,
            ready="Unknown",
            configurations_ready="Unknown",
            routes_ready="Unknown",
        ),
        False,
        CopyReason.NO_READY_REVISION,
        (),
    ),
    "route not ready (ingress)": (
        knative_service(
            "shop",
            ready="False",
            routes_ready="False",
            routes_reason="IngressNotConfigured",
            routes_message="Ingress has not yet been reconciled.",
        ),
        False,
        CopyReason.ROUTE_NOT_READY,
        (),
    ),
    "ready revision but no traffic assigned": (
        knative_service("shop", traffic=[]),
        False,
        CopyReason.ROUTE_NOT_READY,
        (),
    ),
}


@pytest.mark.parametrize(("raw", "healthy", "reason", "revisions"), CASES.values(), ids=CASES.keys())
def test_service_status(raw: dict[str, Any], healthy: bool, reason: CopyReason, revisions: tuple[str, ...]) -> None:
    status = service_status("shop", record(raw))
    assert (status.healthy, status.reason) == (healthy, reason)
    if healthy:
        assert status.revisions == revisions
    assert status.namespace == "projects" and status.service == "shop"
    assert status.detail  # always says why


def test_failed_rollout_detail_names_the_failed_revision() -> None:
    status = service_status("shop", record(CASES["new revision failed, old one serving"][0]))
    assert "shop-00002 failed" in status.detail and "serving shop-00001" in status.detail


def test_route_not_ready_detail_carries_the_condition() -> None:
    status = service_status("shop", record(CASES["route not ready (ingress)"][0]))
    assert "IngressNotConfigured" in status.detail


def test_missing_and_deleting_services_are_not_found() -> None:
    assert service_status("shop", None).reason is CopyReason.NOT_FOUND
    raw = knative_service("shop")
    raw["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert service_status("shop", record(raw)).reason is CopyReason.NOT_FOUND
    assert not_synced_status("shop").reason is CopyReason.CACHE_NOT_SYNCED


def binding(streaming: bool, lag: float | None = None) -> BindingStatus:
    return BindingStatus("shop", "projects", "shop-db", streaming, lag, "detail")


@pytest.mark.parametrize(
    ("bindings", "healthy", "reason"),
    [
        ((), True, CopyReason.OK),  # no bindings: no data condition
        ((binding(True, 0.5),), True, CopyReason.OK),
        ((binding(True, 3600.0),), True, CopyReason.OK),  # lagging degrades the region, not the copy
        ((binding(False),), False, CopyReason.DATA_NOT_STREAMING),
        ((binding(True), binding(False)), False, CopyReason.DATA_NOT_STREAMING),
    ],
)
def test_data_condition(bindings: tuple[BindingStatus, ...], healthy: bool, reason: CopyReason) -> None:
    status = copy_status("shop", record(knative_service("shop")), bindings)
    assert (status.healthy, status.reason) == (healthy, reason)


def test_service_problems_come_before_data_problems() -> None:
    raw = knative_service("shop", traffic=[])
    assert copy_status("shop", record(raw), (binding(False),)).reason is CopyReason.ROUTE_NOT_READY


@pytest.mark.parametrize(
    ("labels", "name", "expected"),
    [
        ({PROJECT_LABEL: "shop"}, "shop-eu", "shop"),
        ({}, "blog", "blog"),  # falls back to the Service name
        ({PROJECT_LABEL: "Not A Slug"}, "blog", "blog"),
        ({PROJECT_LABEL: "Not A Slug"}, "Bad_Name", None),
    ],
)
def test_slug_of(labels: dict[str, str], name: str, expected: str | None) -> None:
    service = KnativeService(namespace="p", name=name, labels=tuple(labels.items()))
    assert slug_of(service, PROJECT_LABEL) == expected
