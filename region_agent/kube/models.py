"""Slim frozen records of the objects the agent watches, and their converters.

An informer keeps only these records, never the raw JSON: a Knative Service is 5-20 KiB of
JSON (managedFields, the whole template) but the agent needs a dozen fields of it. Records are
frozen, hashable and comparable, so the cache can tell "nothing the agent keeps changed" and
swallow that event.

Every ``from_api`` validates: a missing ``metadata.name`` raises
:class:`~region_agent.kube.errors.MalformedObjectError` (the informer logs, counts and skips it); every
other field is optional and a missing or mistyped one becomes its neutral value (None, "", 0,
empty tuple) instead of an exception. Timestamps become Unix seconds (float) so usage metering
does arithmetic on numbers, not strings.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, TypeVar

from region_agent.kube.errors import MalformedObjectError

Labels = tuple[tuple[str, str], ...]

MESSAGE_LIMIT = 300  # condition messages can be whole stack traces; keep the start

KNATIVE_CONDITIONS = ("Ready", "ConfigurationsReady", "RoutesReady")


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
