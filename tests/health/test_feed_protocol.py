"""The feed's wire format: round trips, deltas, and everything a bad line can be."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from region_agent.health.feed_protocol import (
    Delta,
    FeedProtocolError,
    Heartbeat,
    Snapshot,
    apply_delta,
    decode,
    encode_delta,
    encode_heartbeat,
    encode_snapshot,
)
from region_agent.state.local import BindingStatus, CopyReason, RegionView
from tests.health.helpers import NOW, copy, many_copies, view

FULL = view(
    many_copies(50),
    bindings=(BindingStatus("p00001", "proj-p00001", "db", True, 1.5, "fine"),),
    watch_errors=("services: 500",),
    degraded=("checks: local errors (EMFILE)",),
)


def test_every_field_of_a_view_survives_a_snapshot() -> None:
    line = encode_snapshot(FULL, 3)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    message = decode(line)
    assert isinstance(message, Snapshot)
    assert message.seq == 3
    assert message.view == FULL
    assert message.view.copies["p00001"].revisions == ("p00001-00001",)
    assert message.view.degraded == ("checks: local errors (EMFILE)",)
    assert RegionView.from_dict(FULL.to_dict()) == FULL  # the other serialization keeps it too


def test_a_change_of_the_agents_problems_travels_in_a_delta() -> None:
    new = dataclasses.replace(FULL, degraded=())
    message = decode(encode_delta(FULL, new, 5))
    assert isinstance(message, Delta) and apply_delta(FULL, message).degraded == ()


def test_a_view_with_every_optional_field_empty_survives() -> None:
    empty = RegionView(region="sfo1", started_at=1.0, generated_at=2.0, synced=False)
    message = decode(encode_snapshot(empty, 0))
    assert isinstance(message, Snapshot) and message.view == empty


def test_delta_carries_only_changes_and_rebuilds_the_view() -> None:
    copies = dict(FULL.copies)
    copies["p00002"] = copy("p00002", CopyReason.ROUTE_NOT_READY, detail="RoutesReady=False")
    del copies["p00003"]
    copies["new"] = copy("new")
    new = dataclasses.replace(FULL, copies=copies, generated_at=NOW + 1, zone_serial=8)
    line = encode_delta(FULL, new, 4)
    raw = json.loads(line)
    assert sorted(raw["upsert"]) == ["new", "p00002"]
    assert raw["remove"] == ["p00003"]
    assert raw["bindings_changed"] is False and raw["view"]["bindings"] == []
    message = decode(line)
    assert isinstance(message, Delta)
    assert apply_delta(FULL, message) == new


def test_delta_with_changed_bindings() -> None:
    new = dataclasses.replace(FULL, bindings=(BindingStatus("p00001", "proj-p00001", "db", False, None),))
    message = decode(encode_delta(FULL, new, 5))
    assert isinstance(message, Delta) and message.bindings_changed
    assert apply_delta(FULL, message) == new
    assert not message.upsert and not message.remove


def test_delta_of_equal_but_rebuilt_copies_is_empty() -> None:
    rebuilt = dataclasses.replace(FULL, copies={s: dataclasses.replace(c) for s, c in FULL.copies.items()})
    raw = json.loads(encode_delta(FULL, rebuilt, 6))
    assert raw["upsert"] == {} and raw["remove"] == []


def test_heartbeat() -> None:
    message = decode(encode_heartbeat(9))
    assert isinstance(message, Heartbeat) and message.seq == 9


def test_unknown_keys_are_ignored_for_forward_compatibility() -> None:
    assert isinstance(decode(b'{"v":1,"type":"heartbeat","seq":1,"from_the_future":true}'), Heartbeat)


def _snapshot_with(**changes: object) -> bytes:
    """A valid snapshot line with one value replaced; ``a__b__0__c`` is the path a.b[0].c."""
    data = json.loads(encode_snapshot(FULL, 1))
    for path, value in changes.items():
        target: Any = data
        *parents, last = path.split("__")
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[last] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"not json",
        b"[]",
        b"null",
        b'{"v":1,"seq":1}',  # no type
        b'{"v":1,"type":"gossip","seq":1}',
        b'{"v":2,"type":"heartbeat","seq":1}',
        b'{"v":1,"type":"heartbeat","seq":-1}',
        b'{"v":1,"type":"heartbeat","seq":"1"}',
        b'{"v":1,"type":"snapshot","seq":1}',  # no view
        _snapshot_with(view__synced="yes"),
        _snapshot_with(view__synced=1),
        _snapshot_with(view__started_at="yesterday"),
        _snapshot_with(view__zone_serial=1.5),
        _snapshot_with(view__watch_errors="one"),
        _snapshot_with(view__copies__p00001__reason="bogus"),
        _snapshot_with(view__copies__p00001__healthy="true"),
        _snapshot_with(view__copies__p00001__slug="p00002"),  # filed under another key
        _snapshot_with(view__copies=[]),
        _snapshot_with(view__bindings__0__lag_seconds="slow"),
        _snapshot_with(view__region=None),
        b'{"v":1,"type":"snapshot","seq":1,"view":{"region":"sfo1","started_at":NaN,"generated_at":1,"synced":true}}',
        b'{"v":1,"type":"snapshot","seq":1,"view":{"region":"sfo1","started_at":Infinity,"generated_at":1,'
        b'"synced":true}}',
        b'{"v":1,"type":"delta","seq":1,"view":{"region":"sfo1","started_at":1,"generated_at":1,"synced":true},'
        b'"bindings_changed":false,"upsert":{"a":{"slug":"b","healthy":true,"reason":"ok"}},"remove":[]}',
        b'{"v":1,"type":"delta","seq":1,"view":{"region":"sfo1","started_at":1,"generated_at":1,"synced":true},'
        b'"bindings_changed":false,"upsert":{},"remove":[1]}',
        b"\xff\xfe",
    ],
)
def test_invalid_lines_are_rejected_with_a_clear_error(line: bytes) -> None:
    with pytest.raises(FeedProtocolError, match="invalid feed message"):
        decode(line)


def test_encoding_refuses_nan() -> None:
    with pytest.raises(ValueError, match="Out of range float"):
        encode_snapshot(dataclasses.replace(FULL, generated_at=float("nan")), 1)
