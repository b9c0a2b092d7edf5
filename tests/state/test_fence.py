"""Fencing records: owned by control, replicated like any entry, and out of every answer."""

from __future__ import annotations

import pytest

from region_agent.globaldns.compiler import ZoneConfig, compile_zone
from region_agent.state.hlc import HybridClock
from region_agent.state.model import (
    CopyHealth,
    Fence,
    Kind,
    ModelError,
    Project,
    Region,
    check_key,
    copy_key,
    decode_value,
    fence_key,
    may_merge,
    may_write,
    owner_of,
    project_key,
    region_key,
)
from region_agent.state.observations import Observations, ObservedState
from region_agent.state.store import OwnershipError, Store, entry_from_json, entry_to_json

CONFIG = ZoneConfig("g.example.com")


def _store(writer: str = "control/c1") -> Store:
    ms = iter(range(1_800_000_000_000, 1_900_000_000_000, 1000))
    return Store(writer=writer, clock=HybridClock(lambda: next(ms)))


def test_fence_key_owner_and_codec() -> None:
    key = fence_key("sfo1")
    assert check_key(key) is Kind.FENCE
    assert owner_of(key) == "control"
    assert may_write("control/c1", key) and may_merge("control/c1", key)
    assert not may_write("sfo1/n1", key) and not may_write("acme/n1", key)
    fence = Fence("sfo1", "maintenance")
    assert decode_value(key, fence.to_dict()) == fence
    with pytest.raises(ModelError):
        decode_value(fence_key("ams1"), fence.to_dict())  # names another key
    with pytest.raises(ValueError):
        Fence("SFO")
    with pytest.raises(ModelError):
        Fence("sfo1", "x" * 257)


def test_store_indexes_fences_and_replicates_them() -> None:
    control = _store()
    control.put_many([(fence_key("sfo1"), Fence("sfo1", "drain"))], writer="control/c1")
    assert dict(control.fenced) == {"sfo1": Fence("sfo1", "drain")}
    assert control.snapshot().fenced == {"sfo1": Fence("sfo1", "drain")}
    peer = _store("ams1/n1")
    entry = entry_from_json(entry_to_json(next(control.entries())))
    result = peer.merge([entry])
    assert not result.rejected and peer.fenced["sfo1"].reason == "drain"
    assert peer.digest() == control.digest()
    control.delete(fence_key("sfo1"))  # unfence: a tombstone
    assert not control.fenced
    with pytest.raises(OwnershipError):
        peer.put(fence_key("sfo1"), Fence("sfo1"))
    assert ObservedState(control, Observations()).fenced == {}


def _zone_state(store: Store) -> None:
    store.put_many([
        (region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",))),
        (region_key("ams1"), Region("ams1", ipv4=("192.0.2.2",))),
        (project_key("shop"), Project("shop", ("sfo1", "ams1"))),
        (project_key("near"), Project("near", ("sfo1", "ams1"), mode="proximity")),  # type: ignore[arg-type]
    ])
    store.put_many([(copy_key(slug, region), CopyHealth(True)) for slug in ("shop", "near")
                    for region in ("sfo1", "ams1")], writer="standalone/t")


def _addresses(store: Store, slug: str) -> object:
    tables = compile_zone(store.snapshot(), CONFIG)
    answers = tables.projects[slug].description["answers"]
    assert isinstance(answers, dict)
    return answers["A"]


def test_compiler_drops_a_fenced_regions_copies() -> None:
    store = _store("standalone/t")
    _zone_state(store)
    assert _addresses(store, "shop") == {"addresses": ["192.0.2.1"], "why": "primary healthy", "outcome": "answer"}
    first = compile_zone(store.snapshot(), CONFIG)
    store.put(fence_key("sfo1"), Fence("sfo1"))
    assert _addresses(store, "shop") == {"addresses": ["192.0.2.2"], "why": "backup group 1", "outcome": "answer"}
    assert _addresses(store, "near") == {"proximity": ["ams1"], "locator": False}
    # An incremental compile sees the fence too (it is part of the basis).
    incremental = compile_zone(store.snapshot(), CONFIG, previous=first, changed_projects=set())
    description = incremental.projects["shop"].description
    assert description["answers"]["A"]["addresses"] == ["192.0.2.2"]  # type: ignore[index]
    assert description["targets"][0]["health"] == "fenced"  # type: ignore[index]
    # Even the all-down answer leaves the fenced region out.
    store.put_many([(copy_key("shop", "ams1"), CopyHealth(False, "down"))])
    assert _addresses(store, "shop") == {"addresses": ["192.0.2.2"], "why": "all down: every address",
                                         "outcome": "answer"}
    store.delete(fence_key("sfo1"))
    assert _addresses(store, "shop") == {"addresses": ["192.0.2.1"], "why": "primary healthy", "outcome": "answer"}
