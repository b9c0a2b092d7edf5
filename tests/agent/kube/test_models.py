"""Converters: realistic objects become slim records; missing optional fields never raise."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from agent.kube.errors import MalformedObjectError
from agent.kube.models import (
    CnpgCluster,
    Condition,
    KnativeService,
    NodePod,
    TrafficTarget,
    effective_requests,
    parse_time,
)
from tests.fakes.kube_objects import PROJECT_LABEL, cnpg_cluster, knative_service, pod


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
    for convert in (KnativeService.from_api, CnpgCluster.from_api, NodePod.from_api):
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


def test_node_pod_for_usage_metering() -> None:
    raw = pod(
        "shop-00001-deployment-abc",
        labels={"serving.knative.dev/service": "shop", "serving.knative.dev/revision": "shop-00001", "x": "y"},
        annotations={"autoscaling.knative.dev/min-scale": "1", "other": "z"},
        containers=[
            {
                "name": "user-container",
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": "1"}},
            },
            {"name": "queue-proxy", "resources": {"requests": {"cpu": "25m", "memory": "400Mi"}}},
        ],
        container_statuses=[
            {
                "name": "user-container",
                "ready": True,
                "restartCount": 2,
                "state": {"running": {"startedAt": "2026-01-01T00:00:10Z"}},
            },
            {"name": "queue-proxy", "ready": False, "state": {"terminated": {"finishedAt": "2026-01-01T00:01:00Z"}}},
        ],
    )
    raw["metadata"]["deletionTimestamp"] = "2026-01-01T00:02:00Z"
    record = NodePod.from_api(raw)
    assert record.uid == "uid-shop-00001-deployment-abc" and record.node == "node-a" and record.phase == "Running"
    assert record.label("serving.knative.dev/revision") == "shop-00001" and record.label("x") is None
    assert record.annotation("autoscaling.knative.dev/min-scale") == "1" and record.annotation("other") is None
    assert record.requests.cpu == Decimal("1.025") and record.requests.memory == Decimal(2**30 + 400 * 2**20)
    assert record.requests.gpus == 1
    assert record.containers[0].running_since == parse_time("2026-01-01T00:00:10Z")
    assert record.containers[0].restart_count == 2
    assert record.containers[1].terminated_at == parse_time("2026-01-01T00:01:00Z")
    assert not record.ready
    assert record.started_at == parse_time("2026-01-01T00:00:05Z")
    assert record.deleting_at == parse_time("2026-01-01T00:02:00Z")


@pytest.mark.parametrize(
    ("spec", "cpu", "memory"),
    [
        ({}, "0", "0"),
        (
            {"containers": [{"resources": {"requests": {"cpu": "100m"}}}, {"resources": {"limits": {"cpu": "1"}}}]},
            "1.1",
            "0",
        ),
        # an init container bigger than the app containers sets the peak
        (
            {
                "containers": [{"resources": {"requests": {"cpu": "100m"}}}],
                "initContainers": [{"resources": {"requests": {"cpu": "2"}}}],
            },
            "2",
            "0",
        ),
        # a sidecar (restartPolicy Always) adds to the app containers and to later init containers
        (
            {
                "containers": [{"resources": {"requests": {"cpu": "1"}}}],
                "initContainers": [
                    {"restartPolicy": "Always", "resources": {"requests": {"cpu": "500m"}}},
                    {"resources": {"requests": {"cpu": "1"}}},
                ],
            },
            "1.5",
            "0",
        ),
        (
            {
                "containers": [{"resources": {"requests": {"memory": "1Mi", "cpu": "bogus"}}}],
                "overhead": {"memory": "1Mi"},
            },
            "0",
            str(2 * 2**20),
        ),
    ],
)
def test_effective_requests(spec: dict[str, Any], cpu: str, memory: str) -> None:
    requests = effective_requests(spec)
    assert requests.cpu == Decimal(cpu) and requests.memory == Decimal(memory)


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
