"""Builders of realistic Kubernetes objects (as the apiserver would return them) for tests.

Each builder returns a plain dict to feed :class:`tests.fakes.kube_api.FakeKubeApi` or a
converter; keyword arguments cover the states the tests need (PLATFORM.md §1.3, §5).
"""

from __future__ import annotations

from typing import Any

PROJECT_LABEL = "region-agent.io/project"


def condition(kind: str, status: str = "True", reason: str = "", message: str = "") -> dict[str, Any]:
    entry = {"type": kind, "status": status, "lastTransitionTime": "2026-01-01T00:00:00Z"}
    if reason:
        entry["reason"] = reason
    if message:
        entry["message"] = message
    return entry


def knative_service(
    name: str,
    *,
    namespace: str = "projects",
    slug: str | None = None,
    labels: dict[str, str] | None = None,
    generation: int = 1,
    observed_generation: int | None = 1,
    latest_ready: str | None = "",
    latest_created: str | None = "",
    traffic: list[tuple[str, int]] | None = None,
    ready: str = "True",
    configurations_ready: str = "True",
    routes_ready: str = "True",
    routes_reason: str = "",
    routes_message: str = "",
    configurations_reason: str = "",
    configurations_message: str = "",
) -> dict[str, Any]:
    """A ``serving.knative.dev/v1`` Service; defaults: rolled out, revision ``<name>-00001`` at 100 %."""
    revision = f"{name}-00001"
    ready_revision = revision if latest_ready == "" else latest_ready
    created_revision = ready_revision if latest_created == "" else latest_created
    all_labels = {PROJECT_LABEL: slug or name, **(labels or {})}
    if slug is None and labels is not None and PROJECT_LABEL not in labels:
        all_labels.pop(PROJECT_LABEL)
    status: dict[str, Any] = {
        "conditions": [
            condition("ConfigurationsReady", configurations_ready, configurations_reason, configurations_message),
            condition("Ready", ready),
            condition("RoutesReady", routes_ready, routes_reason, routes_message),
        ],
        "url": f"https://{name}.{namespace}.example.com",
        "traffic": [
            {"revisionName": rev, "percent": percent, "latestRevision": rev == ready_revision}
            for rev, percent in (traffic if traffic is not None else [(revision, 100)] if ready_revision else [])
        ],
    }
    if observed_generation is not None:
        status["observedGeneration"] = observed_generation
    if ready_revision:
        status["latestReadyRevisionName"] = ready_revision
    if created_revision:
        status["latestCreatedRevisionName"] = created_revision
    return {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "generation": generation,
            "labels": all_labels,
            "annotations": {"serving.knative.dev/creator": "system:admin"},
            "managedFields": [{"manager": "controller", "operation": "Update", "fieldsV1": {"f:status": {}}}],
        },
        "spec": {
            "template": {
                "metadata": {"annotations": {"autoscaling.knative.dev/min-scale": "0"}},
                "spec": {"containers": [{"image": f"registry.example.com/{name}@sha256:{'0' * 64}"}]},
            },
            "traffic": [{"latestRevision": True, "percent": 100}],
        },
        "status": status,
    }


def cnpg_cluster(
    name: str,
    *,
    namespace: str = "projects",
    slug: str | None = None,
    current_primary: str | None = "",
    replica: bool = True,
    phase: str = "Cluster in healthy state",
    reported_ip: str | None = None,
) -> dict[str, Any]:
    """A ``postgresql.cnpg.io/v1`` Cluster bound to ``slug``; by default a replica cluster."""
    primary = f"{name}-1" if current_primary == "" else current_primary
    status: dict[str, Any] = {
        "phase": phase,
        "instances": 1,
        "readyInstances": 1,
        "conditions": [condition("Ready", "True", "ClusterIsReady")],
    }
    if primary:
        status["currentPrimary"] = primary
        status["targetPrimary"] = primary
        state: dict[str, Any] = {"isPrimary": True, "timeLineID": 1}
        if reported_ip:
            state["ip"] = reported_ip
        status["instancesReportedState"] = {primary: state}
    labels = {PROJECT_LABEL: slug} if slug else {}
    return {
        "apiVersion": "postgresql.cnpg.io/v1",
        "kind": "Cluster",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"instances": 1, "replica": {"enabled": replica, "source": "origin"} if replica else {}},
        "status": status,
    }


def pod(
    name: str,
    *,
    namespace: str = "projects",
    node: str = "node-a",
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ip: str | None = "10.0.0.10",
    containers: list[dict[str, Any]] | None = None,
    container_statuses: list[dict[str, Any]] | None = None,
    start_time: str | None = "2026-01-01T00:00:05Z",
) -> dict[str, Any]:
    """A core v1 Pod; defaults to a ready Knative-style pod with one user container."""
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    if start_time:
        status["startTime"] = start_time
    status["containerStatuses"] = (
        container_statuses
        if container_statuses is not None
        else [
            {
                "name": "user-container",
                "ready": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": "2026-01-01T00:00:07Z"}},
            },
        ]
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "labels": labels if labels is not None else {"serving.knative.dev/service": "shop"},
            "annotations": annotations or {},
        },
        "spec": {
            "nodeName": node,
            "containers": containers
            if containers is not None
            else [
                {"name": "user-container", "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}}},
            ],
        },
        "status": status,
    }
