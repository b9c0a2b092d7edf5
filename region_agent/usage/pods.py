"""The slim pod record metering needs, and its converter from the API's JSON.

The pod informer keeps these instead of whole pods (a pod is ~10 KiB of JSON, this is a few
hundred bytes) and compares them to decide whether a MODIFIED matters, so the record holds
exactly what the session rules read: container run times, phase, deletion time and size.
Timestamps are whole Unix seconds, the granularity of Kubernetes' own ``startedAt`` and
``finishedAt``; metering never needs finer.

The converter is pure and raises :class:`PodFormatError` for an object it can not meter;
the informer counts it as malformed and skips it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from region_agent.kube.quantity import QuantityError, millicores, whole_units
from region_agent.usage.settings import REVISION_LABEL, UsageSettings


class PodFormatError(ValueError):
    """A pod object without a field metering can not do without (uid, name, a parsable size)."""


@dataclass(frozen=True, slots=True)
class Size:
    """What the pod reserves on the node while it runs: the sum of its containers' requests."""

    cpu_millis: int = 0
    memory_bytes: int = 0
    extended: tuple[tuple[str, int], ...] = ()  # GPUs and other extended resources, sorted by name

    def to_wire(self) -> dict[str, Any]:
        return {"cpu_millis": self.cpu_millis, "memory_bytes": self.memory_bytes,
                "extended": dict(self.extended)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Size:
        extended = data.get("extended") or {}
        return cls(int(data["cpu_millis"]), int(data["memory_bytes"]),
                   tuple(sorted((str(k), int(v)) for k, v in extended.items())))


@dataclass(frozen=True, slots=True)
class ContainerRun:
    """One regular container's state, reduced to the instants that bound its runs."""

    name: str
    running: bool = False  # state.running is set
    running_since: int | None = None  # state.running.startedAt (None also when the runtime omitted it)
    terminated_at: int | None = None  # state.terminated.finishedAt: stopped now, at that time
    last_terminated_at: int | None = None  # lastState.terminated.finishedAt: the previous run's end
    restarts: int = 0


@dataclass(frozen=True, slots=True)
class PodIdentity:
    """What a usage record says about whose pod it was; fixed for the pod's life."""

    uid: str
    namespace: str
    name: str
    slug: str
    service: str
    revision: str
    min_scale: int = 0

    @property
    def always_on(self) -> bool:
        return self.min_scale >= 1

    def to_wire(self) -> dict[str, Any]:
        return {"uid": self.uid, "namespace": self.namespace, "name": self.name, "slug": self.slug,
                "service": self.service, "revision": self.revision, "min_scale": self.min_scale}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> PodIdentity:
        return cls(str(data["uid"]), str(data["namespace"]), str(data["name"]), str(data["slug"]),
                   str(data["service"]), str(data["revision"]), int(data.get("min_scale", 0)))


@dataclass(frozen=True, slots=True)
class MeteredPod:
    """A project pod on this node as metering sees it."""

    identity: PodIdentity
    node: str
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    reason: str = ""  # status.reason: Evicted, NodeLost, Shutdown, ...
    containers: tuple[ContainerRun, ...] = ()
    size: Size = Size()
    deletion_at: int | None = None  # metadata.deletionTimestamp: the pod is gone by then at the latest
    not_ready_since: int | None = None  # Ready condition False: its lastTransitionTime

    @property
    def uid(self) -> str:
        return self.identity.uid


def parse_time(value: object) -> int | None:
    """RFC 3339 (``2026-01-01T00:00:00Z``, fractions allowed) → whole Unix seconds, rounded down."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() // 1)
    except ValueError:
        return None


def pod_selectors(settings: UsageSettings, node: str) -> tuple[str, str]:
    """(labelSelector, fieldSelector) of the pod watch: project pods scheduled on ``node``."""
    return settings.service_label, f"spec.nodeName={node}"


def pod_converter(settings: UsageSettings) -> Callable[[Mapping[str, Any]], MeteredPod]:
    """The informer's ``convert`` for the usage pod watch."""

    def convert(obj: Mapping[str, Any]) -> MeteredPod:
        return metered_pod_from_api(obj, settings)

    return convert


def metered_pod_from_api(obj: Mapping[str, Any], settings: UsageSettings) -> MeteredPod:
    meta: Mapping[str, Any] = obj.get("metadata") or {}
    spec: Mapping[str, Any] = obj.get("spec") or {}
    status: Mapping[str, Any] = obj.get("status") or {}
    uid, name = meta.get("uid"), meta.get("name")
    if not uid or not name:
        raise PodFormatError("pod without metadata.uid or metadata.name")
    labels: Mapping[str, str] = meta.get("labels") or {}
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    service = labels.get(settings.service_label, "")
    slug = (labels.get(settings.slug_label) if settings.slug_label else None) or service
    identity = PodIdentity(
        uid=str(uid), namespace=str(meta.get("namespace") or ""), name=str(name), slug=slug,
        service=service, revision=labels.get(REVISION_LABEL, ""),
        min_scale=_min_scale(annotations, settings.min_scale_annotations),
    )
    return MeteredPod(
        identity=identity,
        node=str(spec.get("nodeName") or ""),
        phase=str(status.get("phase") or "Pending"),
        reason=str(status.get("reason") or ""),
        containers=_containers(spec, status),
        size=_size(spec),
        deletion_at=parse_time(meta.get("deletionTimestamp")),
        not_ready_since=_not_ready_since(status),
    )


def _min_scale(annotations: Mapping[str, str], keys: tuple[str, ...]) -> int:
    for key in keys:
        if key in annotations:
            try:
                return max(0, int(str(annotations[key]).strip()))
            except ValueError:
                return 0
    return 0


def _containers(spec: Mapping[str, Any], status: Mapping[str, Any]) -> tuple[ContainerRun, ...]:
    statuses = {s.get("name"): s for s in status.get("containerStatuses") or ()}
    runs = []
    # Every regular container of the spec counts, so one without a status yet is "not running".
    for container in spec.get("containers") or ():
        name = str(container.get("name") or "")
        cs: Mapping[str, Any] = statuses.get(name) or {}
        state: Mapping[str, Any] = cs.get("state") or {}
        last: Mapping[str, Any] = cs.get("lastState") or {}
        running = state.get("running")
        terminated = state.get("terminated")
        last_terminated = last.get("terminated")
        runs.append(ContainerRun(
            name=name,
            running=isinstance(running, dict),
            running_since=parse_time(running.get("startedAt")) if isinstance(running, dict) else None,
            terminated_at=parse_time(terminated.get("finishedAt")) if isinstance(terminated, dict) else None,
            last_terminated_at=(parse_time(last_terminated.get("finishedAt"))
                                if isinstance(last_terminated, dict) else None),
            restarts=int(cs.get("restartCount") or 0),
        ))
        # A running container whose startedAt is missing (some runtimes while starting) gets no
        # start time; the session rules then use the observation time.
    return tuple(runs)


def _size(spec: Mapping[str, Any]) -> Size:
    cpu = memory = 0
    extended: dict[str, int] = {}
    containers = list(spec.get("containers") or ())
    # Native sidecars (init containers with restartPolicy Always) run beside the app and hold
    # their requests for the pod's whole life; ordinary init containers are done before it runs.
    containers += [c for c in spec.get("initContainers") or () if c.get("restartPolicy") == "Always"]
    amounts: list[Mapping[str, Any]] = []
    for container in containers:
        resources: Mapping[str, Any] = container.get("resources") or {}
        # The apiserver defaults a missing request to the limit; do the same for objects that skipped it.
        amounts.append({**(resources.get("limits") or {}), **(resources.get("requests") or {})})
    if spec.get("overhead"):
        amounts.append(spec["overhead"])  # RuntimeClass overhead is reserved like a request
    try:
        for amount in amounts:
            for resource, quantity in amount.items():
                if resource == "cpu":
                    cpu += millicores(quantity)
                elif resource == "memory":
                    memory += whole_units(quantity)
                elif "/" in resource:  # domain-qualified extended resource: nvidia.com/gpu, amd.com/gpu, ...
                    extended[resource] = extended.get(resource, 0) + whole_units(quantity)
    except QuantityError as exc:
        raise PodFormatError(str(exc)) from exc
    return Size(cpu, memory, tuple(sorted(extended.items())))


def _not_ready_since(status: Mapping[str, Any]) -> int | None:
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Ready" and condition.get("status") == "False":
            return parse_time(condition.get("lastTransitionTime"))
    return None
