"""Pod objects as the Kubernetes API returns them, built from a few words (tests only)."""

from __future__ import annotations

import time
from typing import Any

SERVICE_LABEL = "serving.knative.dev/service"


def ts(seconds: float) -> str:
    """Unix seconds → RFC 3339 the way the apiserver writes it (whole seconds, Z)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(seconds)))


def running(since: int | None, *, restarts: int = 0, last_finished: int | None = None,
            ready: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {"state": {"running": {} if since is None else {"startedAt": ts(since)}},
                              "restartCount": restarts, "ready": ready}
    if last_finished is not None:
        status["lastState"] = {"terminated": {"exitCode": 1, "finishedAt": ts(last_finished)}}
    return status


def waiting(*, restarts: int = 0, last_finished: int | None = None,
            reason: str = "CrashLoopBackOff") -> dict[str, Any]:
    status: dict[str, Any] = {"state": {"waiting": {"reason": reason}}, "restartCount": restarts, "ready": False}
    if last_finished is not None:
        status["lastState"] = {"terminated": {"exitCode": 1, "finishedAt": ts(last_finished)}}
    return status


def terminated(finished: int, *, started: int | None = None, restarts: int = 0) -> dict[str, Any]:
    term: dict[str, Any] = {"exitCode": 0, "finishedAt": ts(finished)}
    if started is not None:
        term["startedAt"] = ts(started)
    return {"state": {"terminated": term}, "restartCount": restarts, "ready": False}


def pod(
    name: str = "shop-00001-deployment-a",
    *,
    uid: str | None = None,
    node: str = "node-a",
    namespace: str = "shop",
    service: str = "shop",
    revision: str = "shop-00001",
    phase: str = "Running",
    reason: str | None = None,
    statuses: list[dict[str, Any]] | None = None,
    names: tuple[str, ...] = ("user-container", "queue-proxy"),
    requests: list[dict[str, str]] | None = None,
    limits: list[dict[str, str]] | None = None,
    sidecars: list[dict[str, str]] | None = None,
    overhead: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    deletion: int | None = None,
    not_ready_since: int | None = None,
    resource_version: str = "1",
) -> dict[str, Any]:
    """A Knative project pod. ``statuses`` are per container (same order as ``names``); None: Pending."""
    if requests is None:
        requests = [{"cpu": "500m", "memory": "256Mi"}, {"cpu": "25m", "memory": "50Mi"}]
    containers = []
    for i, cname in enumerate(names):
        resources: dict[str, Any] = {}
        if i < len(requests):
            resources["requests"] = requests[i]
        if limits is not None and i < len(limits):
            resources["limits"] = limits[i]
        containers.append({"name": cname, "image": "example/app", "resources": resources})
    spec: dict[str, Any] = {"nodeName": node, "containers": containers}
    if sidecars:
        spec["initContainers"] = [{"name": f"sidecar-{i}", "restartPolicy": "Always", "resources": {"requests": r}}
                                  for i, r in enumerate(sidecars)] + [
            {"name": "init", "resources": {"requests": {"cpu": "4", "memory": "4Gi"}}}]
    if overhead:
        spec["overhead"] = overhead
    status: dict[str, Any] = {"phase": phase}
    if reason:
        status["reason"] = reason
    if statuses is not None:
        status["containerStatuses"] = [{"name": cname, **s} for cname, s in zip(names, statuses, strict=False)]
    if not_ready_since is not None:
        status["conditions"] = [{"type": "Ready", "status": "False", "lastTransitionTime": ts(not_ready_since)}]
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace, "uid": uid or f"uid-{name}", "resourceVersion": resource_version,
        "labels": {SERVICE_LABEL: service, "serving.knative.dev/revision": revision, **(labels or {})},
        "annotations": dict(annotations or {}),
    }
    if deletion is not None:
        meta["deletionTimestamp"] = ts(deletion)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


def up(since: int, **kw: Any) -> dict[str, Any]:
    """A running pod whose two containers came up at ``since``."""
    return pod(statuses=[running(since), running(since)], **kw)


def down(finished: int, *, phase: str = "Succeeded", **kw: Any) -> dict[str, Any]:
    """A pod whose containers both stopped at ``finished``."""
    return pod(phase=phase, statuses=[terminated(finished), terminated(finished)], **kw)
