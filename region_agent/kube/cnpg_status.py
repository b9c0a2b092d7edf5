"""A binding's data condition from the CloudNativePG instance manager: pure rules.

The Cluster resource does not say whether a replica streams (PLATFORM.md §0.9, §5.1: ``Ready``
stays True with replication broken). The instance manager of the Cluster's current primary pod
does: ``GET :8000/pg/status`` returns ``isPrimary``, ``isWalReceiverActive``, ``receivedLsn``,
``replayLsn``, ``replayPaused``; its exporter (``:9187/metrics``) has ``cnpg_pg_replication_lag``
in seconds. The poller (:mod:`region_agent.kube.cnpg_poller`) fetches those; this module decides.

In a replica cluster (distributed topology) the Cluster's ``currentPrimary`` is the *designated
primary*: it runs in recovery and streams from the source region, so it is the pod whose WAL
receiver says whether this region's data follows. In a primary cluster it is the primary.

================================================  =========  ========  ====================
instance status                                    streaming  lagging   detail
================================================  =========  ========  ====================
``isPrimary`` true                                 yes        no        primary (no data condition)
in recovery, WAL receiver active, lag <= limit     yes        no        streaming, lag, backlog
in recovery, WAL receiver active, lag > limit      yes        yes       lagging (degraded only)
in recovery, WAL receiver active, replay paused    yes        yes       replay paused
in recovery, WAL receiver inactive                 no         no        not streaming
no status yet / Cluster without a current primary  no         no        why
polls failing for longer than ``grace``            no         no        the last error
polls failing within ``grace``                     last good  last good last good + the error
Cluster being deleted                              no         no        being deleted
================================================  =========  ========  ====================

"streaming" is the data condition of :class:`~region_agent.state.local.BindingStatus`; a failing one
takes the copy out of the DNS answers (``data-not-streaming``). "lagging" only degrades the
region; it is reported through ``lag_seconds`` (the health listener compares it with the same
threshold) and the detail text. Lag comes from the exporter when it answers; the byte backlog
(received − replayed LSN) is always shown in the detail.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from region_agent.kube.errors import MalformedObjectError
from region_agent.kube.models import CnpgCluster
from region_agent.state.local import BindingStatus


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """The fields of ``/pg/status`` the agent uses."""

    is_primary: bool
    wal_receiver_active: bool = False
    received_lsn: int | None = None
    replay_lsn: int | None = None
    replay_paused: bool = False

    @property
    def backlog_bytes(self) -> int | None:
        if self.received_lsn is None or self.replay_lsn is None:
            return None
        return max(0, self.received_lsn - self.replay_lsn)


@dataclass(frozen=True, slots=True)
class Observation:
    """What the poller knows about one binding: the last good status and the last error."""

    status: InstanceStatus | None = None
    lag_seconds: float | None = None
    observed_at: float | None = None  # wall time of the last successful poll
    error: str | None = None  # why the latest poll failed; None when it succeeded


def parse_lsn(value: Any) -> int | None:
    """PostgreSQL LSN text ``"16/B374D848"`` → integer byte position; None when absent or invalid."""
    if not isinstance(value, str) or "/" not in value:
        return None
    high, _, low = value.partition("/")
    try:
        return (int(high, 16) << 32) | int(low, 16)
    except ValueError:
        return None


def parse_instance_status(document: Mapping[str, Any]) -> InstanceStatus:
    """Validate a ``/pg/status`` answer; raise :class:`MalformedObjectError` when it is not one."""
    if not isinstance(document, Mapping):
        raise MalformedObjectError("/pg/status answer is not a JSON object")
    is_primary = document.get("isPrimary")
    if not isinstance(is_primary, bool):
        raise MalformedObjectError("/pg/status answer without a boolean isPrimary")
    return InstanceStatus(
        is_primary=is_primary,
        wal_receiver_active=document.get("isWalReceiverActive") is True,
        received_lsn=parse_lsn(document.get("receivedLsn")),
        replay_lsn=parse_lsn(document.get("replayLsn")),
        replay_paused=document.get("replayPaused") is True,
    )


def parse_replication_lag(metrics_text: str) -> float | None:
    """``cnpg_pg_replication_lag`` (seconds) from the exporter's text format; None if absent."""
    try:
        for family in text_string_to_metric_families(metrics_text):
            if family.name == "cnpg_pg_replication_lag":
                for sample in family.samples:
                    if sample.name == "cnpg_pg_replication_lag" and math.isfinite(sample.value):
                        return max(0.0, float(sample.value))
    except ValueError:
        return None
    return None


def binding_status(
    *,
    slug: str,
    cluster: CnpgCluster,
    observation: Observation | None,
    now: float,
    lag_threshold: float,
    grace: float,
) -> BindingStatus:
    """The table in the module docstring."""

    def result(streaming: bool, detail: str, lag: float | None = None) -> BindingStatus:
        return BindingStatus(slug, cluster.namespace, cluster.name, streaming, lag, detail)

    if cluster.deleting:
        return result(False, "the Cluster is being deleted")
    if cluster.current_primary is None:
        return result(False, f"the Cluster has no current primary yet (phase {cluster.phase or 'unknown'!r})")
    if observation is None or observation.status is None or observation.observed_at is None:
        why = f": {observation.error}" if observation is not None and observation.error else ""
        return result(False, f"instance status of {cluster.current_primary} not known yet{why}")
    if observation.error is not None:
        age = now - observation.observed_at
        if age > grace:
            return result(False, f"instance status unavailable for {age:.0f} s: {observation.error}")
    status, lag = observation.status, observation.lag_seconds
    suffix = f" (last poll failed: {observation.error})" if observation.error else ""

    if status.is_primary:
        return result(True, "primary" + suffix)
    if not status.wal_receiver_active:
        return result(
            False,
            f"{cluster.current_primary} is in recovery but its WAL receiver is not active" + suffix,
            lag,
        )
    facts = [f"lag {lag:.1f} s" if lag is not None else "lag unknown"]
    if status.backlog_bytes is not None:
        facts.append(f"replay backlog {status.backlog_bytes} bytes")
    if status.replay_paused:
        state = "streaming, replay paused"
    elif lag is not None and lag > lag_threshold:
        state = f"streaming, lagging over {lag_threshold:g} s"
    else:
        state = "streaming"
    return result(True, f"{state}: {', '.join(facts)}{suffix}", lag)


def is_lagging(binding: BindingStatus, lag_threshold: float) -> bool:
    """The degraded-but-healthy rule, shared with whoever reports the region."""
    return binding.streaming and binding.lag_seconds is not None and binding.lag_seconds > lag_threshold
