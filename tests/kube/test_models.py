"""Converters: realistic objects become slim records; missing optional fields never raise."""

from __future__ import annotations

from typing import Any

import pytest

from region_agent.kube.errors import MalformedObjectError
from region_agent.kube.models import (
    CnpgCluster,
    Condition,
    KnativeService,
    TrafficTarget,
    parse_time,
)
from tests.fakes.kube_objects import PROJECT_LABEL, cnpg_cluster, knative_service


def test_knative_service_keeps_only_what_copy_health_needs() -> None:
    raw = knative_service(
        "shop",
        slug="shop",
        traffic=[("shop-00001", 90), ("shop-00002", 10)],
        latest_created="shop-00003",
        configurations_ready="False",
        configurations_reason="RevisionFailed",
        configurations_message="x" * 1000,
    )
    record = KnativeService.from_api(raw, keep_labels=(PROJECT_LABEL,))
    assert record.namespace == "projects" and record.name == "shop"
    assert record.generation == 1 and record.observed_generation == 1 and record.reconciled
    assert record.latest_ready_revision == "shop-00001" and record.latest_created_revision == "shop-00003"
    assert record.traffic == (TrafficTarget("shop-00001", 90, True), TrafficTarget("shop-00002", 10, False))
    assert record.labels == ((PROJECT_LABEL, "shop"),) and record.label(PROJECT_LABEL) == "shop"
    configurations = record.condition("ConfigurationsReady")
    assert configurations is not None and configurations.status == "False"
    assert len(configurations.message) == 300
    assert {c.type for c in record.conditions} == {"Ready", "ConfigurationsReady", "RoutesReady"}
    assert not record.deleting
    assert hash(record) == hash(KnativeService.from_api(raw, keep_labels=(PROJECT_LABEL,)))


@pytest.mark.parametrize(
    "raw",
    [
        {"metadata": {"name": "bare"}},
        {"metadata": {"name": "bare", "namespace": 5, "labels": "oops", "generation": "7"}, "status": []},
        {
            "metadata": {"name": "bare"},
            "status": {
                "traffic": [None, {"percent": "x"}, {"revisionName": 3}],
                "conditions": [None, {"status": True}],
            },
        },
    ],
)
def test_knative_service_tolerates_missing_or_mistyped_optional_fields(raw: dict[str, Any]) -> None:
    record = KnativeService.from_api(raw, keep_labels=(PROJECT_LABEL,))
    assert record.name == "bare" and record.generation is None and record.traffic == ()
    assert record.conditions == () and record.labels == ()


@pytest.mark.parametrize("raw", [{}, {"metadata": {}}, {"metadata": {"name": ""}}, {"metadata": "x"}, []])
def test_objects_without_a_name_are_malformed(raw: Any) -> None:
    for convert in (KnativeService.from_api, CnpgCluster.from_api):
        with pytest.raises(MalformedObjectError):
            convert(raw)


def test_deleting_flag() -> None:
    raw = knative_service("shop")
    raw["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert KnativeService.from_api(raw).deleting


def test_cnpg_cluster() -> None:
    record = CnpgCluster.from_api(cnpg_cluster("db", slug="shop", reported_ip="10.1.1.1"), keep_labels=(PROJECT_LABEL,))
    assert record.current_primary == "db-1" and record.target_primary == "db-1"
    assert record.replica and record.primary_ip == "10.1.1.1" and record.label(PROJECT_LABEL) == "shop"
    assert record.conditions == (Condition("Ready", "True", "ClusterIsReady"),)
    assert CnpgCluster.from_api({"metadata": {"name": "x"}}).current_primary is None


@pytest.mark.parametrize(
    ("replica", "expected"),
    [
        ({}, False),
        ({"enabled": True}, True),
        ({"enabled": False, "primary": "other"}, False),
        ({"primary": "other"}, True),  # distributed topology: we are not the primary
        ({"primary": "db"}, False),
        ({"primary": "east", "self": "east"}, False),
        ({"primary": "east", "self": "west"}, True),
    ],
)
def test_cnpg_is_replica(replica: dict[str, Any], expected: bool) -> None:
    raw = {"metadata": {"name": "db"}, "spec": {"replica": replica}}
    assert CnpgCluster.from_api(raw).replica is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-01-01T00:00:00Z", 1767225600.0),
        ("2026-01-01T00:00:00.5Z", 1767225600.5),
        ("", None),
        (None, None),
        ("yesterday", None),
        (5, None),
    ],
)
def test_parse_time(text: Any, expected: float | None) -> None:
    assert parse_time(text) == expected
