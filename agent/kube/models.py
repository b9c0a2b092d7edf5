"""Slim frozen records of the objects the agent watches, and their converters.

An informer keeps only these records, never the raw JSON: a Knative Service is 5-20 KiB of
JSON (managedFields, the whole template) but the agent needs a dozen fields of it. Records are
frozen, hashable and comparable, so the cache can tell "nothing the agent keeps changed" and
swallow that event.

Every ``from_api`` validates: a missing ``metadata.name`` raises
:class:`~agent.kube.errors.MalformedObjectError` (the informer logs, counts and skips it); every
other field is optional and a missing or mistyped one becomes its neutral value (None, "", 0,
empty tuple) instead of an exception. Timestamps become Unix seconds (float) so usage metering
does arithmetic on numbers, not strings.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from functools import lru_cache
from typing import Any, TypeVar

from agent.kube.errors import MalformedObjectError
from agent.kube.quantity import QuantityError, parse_quantity

Labels = tuple[tuple[str, str], ...]

MESSAGE_LIMIT = 300  # condition messages can be whole stack traces; keep the start

KNATIVE_CONDITIONS = ("Ready", "ConfigurationsReady", "RoutesReady")
POD_LABELS = (
    "serving.knative.dev/service",
    "serving.knative.dev/revision",
    "serving.knative.dev/configuration",
    "serving.knative.dev/serviceUID",
    "serving.knative.dev/revisionUID",
    "app",
)
POD_ANNOTATIONS = (
    "autoscaling.knative.dev/min-scale",
    "autoscaling.knative.dev/max-scale",
    "autoscaling.knative.dev/minScale",
    "autoscaling.knative.dev/maxScale",
)
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/i915")


# -- tolerant field access --------------------------------------------------------------------

_Shared = TypeVar("_Shared")


@lru_cache(maxsize=4096)
def _shared(value: _Shared) -> _Shared:
    """One instance per distinct value: most Services carry identical condition tuples, and
    10,000 copies of ``Condition("Ready", "True")`` would cost ~1 MB for nothing."""
    return value


def _name(value: Any) -> str:
    """Names repeated across fields and records (namespaces, revisions) share one string."""
    return sys.intern(value) if isinstance(value, str) else ""


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _optional_text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _flag(value: Any) -> bool:
    return value is True


def parse_time(value: Any) -> float | None:
    """RFC 3339 (``2026-01-01T00:00:00Z``, with or without fractions) → Unix seconds; else None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def _metadata(obj: Mapping[str, Any]) -> tuple[Mapping[str, Any], str, str]:
    if not isinstance(obj, Mapping):
        raise MalformedObjectError("object is not a JSON object")
    metadata = _mapping(obj.get("metadata"))
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedObjectError("object without metadata.name")
    return metadata, _name(metadata.get("namespace")), name


def _subset(values: Any, keys: Iterable[str]) -> Labels:
    source = _mapping(values)
    return tuple((k, source[k]) for k in keys if isinstance(source.get(k), str))


def _lookup(pairs: Labels, key: str) -> str | None:
    for name, value in pairs:
        if name == key:
            return value
    return None


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: str  # "True", "False", "Unknown"
    reason: str = ""
    message: str = ""


def _conditions(status: Mapping[str, Any], wanted: Collection[str]) -> tuple[Condition, ...]:
    result = []
    for raw in _list(status.get("conditions")):
        entry = _mapping(raw)
        kind = _text(entry.get("type"))
        if kind in wanted:
            result.append(
                Condition(
                    kind,
                    _text(entry.get("status")) or "Unknown",
                    _text(entry.get("reason")),
                    _text(entry.get("message"))[:MESSAGE_LIMIT],
                )
            )
    shared: tuple[Condition, ...] = _shared(tuple(result))
    return shared


def _find(conditions: tuple[Condition, ...], kind: str) -> Condition | None:
    for condition in conditions:
        if condition.type == kind:
            return condition
    return None


# -- Knative Service --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrafficTarget:
    """One entry of ``status.traffic``: a revision and the share of requests it gets now."""

    revision: str
    percent: int
    latest: bool = False
    tag: str = ""


@dataclass(frozen=True, slots=True)
class KnativeService:
    """``serving.knative.dev/v1`` Service: what copy health needs (PLATFORM.md §1)."""

    namespace: str
    name: str
    generation: int | None = None
    observed_generation: int | None = None
    latest_ready_revision: str | None = None
    latest_created_revision: str | None = None
    traffic: tuple[TrafficTarget, ...] = ()
    conditions: tuple[Condition, ...] = ()
    labels: Labels = ()
    deleting: bool = False

    @classmethod
    def from_api(cls, obj: Mapping[str, Any], *, keep_labels: Iterable[str] = ()) -> KnativeService:
        metadata, namespace, name = _metadata(obj)
        status = _mapping(obj.get("status"))
        traffic = []
        for raw in _list(status.get("traffic")):
            entry = _mapping(raw)
            revision = _name(entry.get("revisionName"))
            if revision:
                traffic.append(
                    TrafficTarget(
                        revision,
                        _integer(entry.get("percent")) or 0,
                        _flag(entry.get("latestRevision")),
                        _text(entry.get("tag")),
                    )
                )
        return cls(
            namespace=namespace,
            name=name,
            generation=_integer(metadata.get("generation")),
            observed_generation=_integer(status.get("observedGeneration")),
            latest_ready_revision=_name(status.get("latestReadyRevisionName")) or None,
            latest_created_revision=_name(status.get("latestCreatedRevisionName")) or None,
            traffic=tuple(traffic),
            conditions=_conditions(status, KNATIVE_CONDITIONS),
            labels=_subset(metadata.get("labels"), keep_labels),
            deleting=metadata.get("deletionTimestamp") is not None,
        )

    def condition(self, kind: str) -> Condition | None:
        return _find(self.conditions, kind)

    def label(self, key: str) -> str | None:
        return _lookup(self.labels, key)

    @property
    def reconciled(self) -> bool:
        """``status.observedGeneration == metadata.generation``: the controller has seen the latest spec."""
        return self.generation is not None and self.generation == self.observed_generation


# -- CloudNativePG Cluster --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CnpgCluster:
    """``postgresql.cnpg.io/v1`` Cluster: which pod to ask for streaming state (PLATFORM.md §5)."""

    namespace: str
    name: str
    labels: Labels = ()
    phase: str = ""
    current_primary: str | None = None
    target_primary: str | None = None
    instances: int | None = None
    ready_instances: int | None = None
    replica: bool = False
    primary_ip: str | None = None  # instancesReportedState[currentPrimary].ip (CNPG 1.26+)
    conditions: tuple[Condition, ...] = ()
    deleting: bool = False

    @classmethod
    def from_api(cls, obj: Mapping[str, Any], *, keep_labels: Iterable[str] = ()) -> CnpgCluster:
        metadata, namespace, name = _metadata(obj)
        spec = _mapping(obj.get("spec"))
        status = _mapping(obj.get("status"))
        current_primary = _optional_text(status.get("currentPrimary"))
        reported = _mapping(_mapping(status.get("instancesReportedState")).get(current_primary or ""))
        return cls(
            namespace=namespace,
            name=name,
            labels=_subset(metadata.get("labels"), keep_labels),
            phase=_text(status.get("phase")),
            current_primary=current_primary,
            target_primary=_optional_text(status.get("targetPrimary")),
            instances=_integer(status.get("instances")),
            ready_instances=_integer(status.get("readyInstances")),
            replica=_is_replica(name, _mapping(spec.get("replica"))),
            primary_ip=_optional_text(reported.get("ip")),
            conditions=_conditions(status, ("Ready",)),
            deleting=metadata.get("deletionTimestamp") is not None,
        )

    def label(self, key: str) -> str | None:
        return _lookup(self.labels, key)


def _is_replica(name: str, replica: Mapping[str, Any]) -> bool:
    """CNPG ``IsReplica``: ``enabled`` when set explicitly, else ``(self or name) != primary``."""
    enabled = replica.get("enabled")
    if isinstance(enabled, bool):
        return enabled
    primary = _optional_text(replica.get("primary"))
    if primary is None:
        return False
    return (_optional_text(replica.get("self")) or name) != primary


# -- Pod on this node (usage metering) --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContainerTimes:
    """One container's state: readiness and the running interval, as Unix seconds."""

    name: str
    ready: bool = False
    running_since: float | None = None
    terminated_at: float | None = None
    restart_count: int = 0


@dataclass(frozen=True, slots=True)
class ResourceRequests:
    """The pod's effective requests (Kubernetes rules, see :func:`effective_requests`)."""

    cpu: Decimal = Decimal(0)  # cores
    memory: Decimal = Decimal(0)  # bytes
    extended: tuple[tuple[str, Decimal], ...] = ()  # e.g. ("nvidia.com/gpu", 1)

    @property
    def gpus(self) -> Decimal:
        return sum((amount for name, amount in self.extended if name in GPU_RESOURCES), Decimal(0))


@dataclass(frozen=True, slots=True)
class NodePod:
    """A pod on this node, for usage sessions (PLATFORM.md §1.5-1.6)."""

    namespace: str
    name: str
    uid: str = ""
    node: str = ""
    phase: str = ""
    labels: Labels = ()
    annotations: Labels = ()
    containers: tuple[ContainerTimes, ...] = ()
    requests: ResourceRequests = ResourceRequests()
    created_at: float | None = None
    started_at: float | None = None  # status.startTime
    deleting_at: float | None = None  # metadata.deletionTimestamp

    @classmethod
    def from_api(
        cls,
        obj: Mapping[str, Any],
        *,
        keep_labels: Iterable[str] = POD_LABELS,
        keep_annotations: Iterable[str] = POD_ANNOTATIONS,
    ) -> NodePod:
        metadata, namespace, name = _metadata(obj)
        spec = _mapping(obj.get("spec"))
        status = _mapping(obj.get("status"))
        return cls(
            namespace=namespace,
            name=name,
            uid=_text(metadata.get("uid")),
            node=_text(spec.get("nodeName")),
            phase=_text(status.get("phase")),
            labels=_subset(metadata.get("labels"), keep_labels),
            annotations=_subset(metadata.get("annotations"), keep_annotations),
            containers=tuple(_container_times(s) for s in _list(status.get("containerStatuses"))),
            requests=effective_requests(spec),
            created_at=parse_time(metadata.get("creationTimestamp")),
            started_at=parse_time(status.get("startTime")),
            deleting_at=parse_time(metadata.get("deletionTimestamp")),
        )

    def label(self, key: str) -> str | None:
        return _lookup(self.labels, key)

    def annotation(self, key: str) -> str | None:
        return _lookup(self.annotations, key)

    @property
    def ready(self) -> bool:
        return bool(self.containers) and all(c.ready for c in self.containers)


def _container_times(raw: Any) -> ContainerTimes:
    entry = _mapping(raw)
    state = _mapping(entry.get("state"))
    running = _mapping(state.get("running"))
    terminated = _mapping(state.get("terminated"))
    return ContainerTimes(
        name=_text(entry.get("name")),
        ready=_flag(entry.get("ready")),
        running_since=parse_time(running.get("startedAt")),
        terminated_at=parse_time(terminated.get("finishedAt")),
        restart_count=_integer(entry.get("restartCount")) or 0,
    )


def _container_requests(container: Mapping[str, Any]) -> dict[str, Decimal]:
    """Requests of one container; a resource with only a limit requests its limit (API defaulting)."""
    resources = _mapping(container.get("resources"))
    merged = {**_mapping(resources.get("limits")), **_mapping(resources.get("requests"))}
    result = {}
    for name, value in merged.items():
        try:
            result[name] = parse_quantity(value)
        except QuantityError:
            continue  # the apiserver validates quantities; a bad one here is not worth a crash
    return result


def _add(total: dict[str, Decimal], more: Mapping[str, Decimal]) -> None:
    for name, amount in more.items():
        total[name] = total.get(name, Decimal(0)) + amount


def effective_requests(spec: Mapping[str, Any]) -> ResourceRequests:
    """Pod requests as the scheduler counts them.

    ``max(sum(app containers) + sum(sidecars), max over init containers of (init + sidecars
    started before it)) + overhead``, per resource; sidecars are init containers with
    ``restartPolicy: Always``.
    """
    running: dict[str, Decimal] = {}
    for container in _list(spec.get("containers")):
        _add(running, _container_requests(_mapping(container)))
    sidecars: dict[str, Decimal] = {}
    init_peak: dict[str, Decimal] = {}
    for container in _list(spec.get("initContainers")):
        entry = _mapping(container)
        requests = _container_requests(entry)
        if entry.get("restartPolicy") == "Always":
            _add(sidecars, requests)
            continue
        during = dict(sidecars)
        _add(during, requests)
        for name, amount in during.items():
            init_peak[name] = max(init_peak.get(name, Decimal(0)), amount)
    _add(running, sidecars)
    total = {
        name: max(running.get(name, Decimal(0)), init_peak.get(name, Decimal(0)))
        for name in running.keys() | init_peak.keys()
    }
    overhead = {}
    for name, value in _mapping(spec.get("overhead")).items():
        try:
            overhead[name] = parse_quantity(value)
        except QuantityError:
            continue
    _add(total, overhead)
    return ResourceRequests(
        cpu=total.pop("cpu", Decimal(0)),
        memory=total.pop("memory", Decimal(0)),
        extended=tuple(sorted(total.items())),
    )
