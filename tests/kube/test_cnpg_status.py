"""Binding data condition from the instance manager's status (PLATFORM.md §5.2) as tables."""

from __future__ import annotations

from typing import Any

import pytest

from region_agent.kube.cnpg_status import (
    InstanceStatus,
    Observation,
    binding_status,
    is_lagging,
    parse_instance_status,
    parse_lsn,
    parse_replication_lag,
)
from region_agent.kube.errors import MalformedObjectError
from region_agent.kube.models import CnpgCluster

NOW = 1_800_000_000.0
CLUSTER = CnpgCluster(namespace="projects", name="shop-db", current_primary="shop-db-1", replica=True)

REPLICA_STREAMING = InstanceStatus(False, True, received_lsn=0x3000100, replay_lsn=0x3000000)
REPLICA_BROKEN = InstanceStatus(False, False, received_lsn=0x3000000, replay_lsn=0x3000000)
PRIMARY = InstanceStatus(True)


def seen(
    status: InstanceStatus, lag: float | None = None, *, age: float = 1.0, error: str | None = None
) -> Observation:
    return Observation(status=status, lag_seconds=lag, observed_at=NOW - age, error=error)


CASES: dict[str, tuple[CnpgCluster, Observation | None, bool, float | None, str]] = {
    "primary: no data condition": (CLUSTER, seen(PRIMARY), True, None, "primary"),
    "replica streaming": (CLUSTER, seen(REPLICA_STREAMING, 0.4), True, 0.4, "replay backlog 256 bytes"),
    "replica streaming, lag unknown": (CLUSTER, seen(REPLICA_STREAMING), True, None, "lag unknown"),
    "replica lagging: degraded, still streaming": (
        CLUSTER,
        seen(REPLICA_STREAMING, 120.0),
        True,
        120.0,
        "lagging over 30 s",
    ),
    "replica replay paused": (
        CLUSTER,
        seen(InstanceStatus(False, True, replay_paused=True), 1.0),
        True,
        1.0,
        "replay paused",
    ),
    "replica not streaming": (CLUSTER, seen(REPLICA_BROKEN, 5.0), False, 5.0, "WAL receiver is not active"),
    "not polled yet": (CLUSTER, None, False, None, "not known yet"),
    "first polls failing": (CLUSTER, Observation(error="connection refused"), False, None, "connection refused"),
    "poll failing within grace keeps the last good status": (
        CLUSTER,
        seen(REPLICA_STREAMING, 0.1, age=10.0, error="timeout"),
        True,
        0.1,
        "last poll failed: timeout",
    ),
    "poll failing beyond grace": (
        CLUSTER,
        seen(REPLICA_STREAMING, 0.1, age=60.0, error="timeout"),
        False,
        None,
        "unavailable for 60 s",
    ),
    "no current primary": (
        CnpgCluster(namespace="projects", name="shop-db", phase="Setting up primary"),
        seen(PRIMARY),
        False,
        None,
        "no current primary",
    ),
    "cluster being deleted": (
        CnpgCluster(namespace="projects", name="shop-db", current_primary="x", deleting=True),
        seen(PRIMARY),
        False,
        None,
        "being deleted",
    ),
}


@pytest.mark.parametrize(("cluster", "observation", "streaming", "lag", "detail"), CASES.values(), ids=CASES.keys())
def test_binding_status(
    cluster: CnpgCluster, observation: Observation | None, streaming: bool, lag: float | None, detail: str
) -> None:
    status = binding_status(
        slug="shop", cluster=cluster, observation=observation, now=NOW, lag_threshold=30.0, grace=20.0
    )
    assert (status.streaming, status.lag_seconds) == (streaming, lag)
    assert detail in status.detail
    assert (status.slug, status.namespace, status.name) == ("shop", "projects", "shop-db")


def test_is_lagging() -> None:
    status = binding_status(
        slug="s", cluster=CLUSTER, observation=seen(REPLICA_STREAMING, 31.0), now=NOW, lag_threshold=30.0, grace=20.0
    )
    assert is_lagging(status, 30.0) and not is_lagging(status, 60.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0/3000060", 0x3000060),
        ("16/B374D848", (0x16 << 32) | 0xB374D848),
        ("", None),
        ("zz/1", None),
        (None, None),
        ("123", None),
    ],
)
def test_parse_lsn(text: Any, expected: int | None) -> None:
    assert parse_lsn(text) == expected


def test_parse_instance_status_of_a_real_answer() -> None:
    document = {
        "currentLsn": "",
        "receivedLsn": "0/5000148",
        "replayLsn": "0/5000100",
        "systemID": "7290419",
        "isPrimary": False,
        "replayPaused": False,
        "pendingRestart": False,
        "isWalReceiverActive": True,
        "timeLineID": 1,
        "isReady": True,
        "node": "node-a",
        "pod": {"metadata": {"name": "shop-db-1"}},
    }
    status = parse_instance_status(document)
    assert status == InstanceStatus(False, True, 0x5000148, 0x5000100, False)
    assert status.backlog_bytes == 0x48


@pytest.mark.parametrize("document", [{}, {"isPrimary": "yes"}, [], {"isWalReceiverActive": True}])
def test_parse_instance_status_rejects_other_documents(document: Any) -> None:
    with pytest.raises(MalformedObjectError):
        parse_instance_status(document)


EXPORTER = """# HELP cnpg_pg_replication_lag Replication lag behind primary in seconds
# TYPE cnpg_pg_replication_lag gauge
cnpg_pg_replication_lag 2.5
# HELP cnpg_pg_replication_in_recovery Whether the instance is in recovery
# TYPE cnpg_pg_replication_in_recovery gauge
cnpg_pg_replication_in_recovery 1
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (EXPORTER, 2.5),
        ("", None),
        ("cnpg_pg_replication_lag NaN\n", None),
        ("not { prometheus", None),
        ("cnpg_pg_replication_lag -1\n", 0.0),
    ],
)
def test_parse_replication_lag(text: str, expected: float | None) -> None:
    assert parse_replication_lag(text) == expected
