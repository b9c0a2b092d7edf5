"""The keyring file: round trip, every validation error, and a watcher rotating live transports' keys."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from region_agent.cli.keys import edit_keyring
from region_agent.gossip.keyfile import (
    KeyringFileError,
    KeyringWatcher,
    apply_keys,
    dump_keyring,
    load_keyring,
    save_keyring,
)
from region_agent.gossip.keyring import Keyring, encode_key
from region_agent.gossip.messages import Address
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.transport import GossipTransport
from tests.conftest import wait_for

K1, K2, K3 = b"1" * 32, b"2" * 16, b"3" * 24
E1, E2, E3 = encode_key(K1), encode_key(K2), encode_key(K3)


def test_round_trip_is_atomic_and_private(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    save_keyring(path, Keyring(K2, [K1, K3]))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"primary": E2, "keys": [E2, E1, E3]}
    ring = load_keyring(path)
    assert ring.primary == K2 and ring.keys() == [K2, K1, K3]
    save_keyring(path, Keyring(K3))  # replaces, and leaves no temporary file behind
    assert load_keyring(path).keys() == [K3]
    assert os.listdir(tmp_path) == ["keyring.json"]


def test_primary_may_be_anywhere_in_keys(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"primary": E3, "keys": [E1, E3, E1]}))
    assert load_keyring(path).keys() == [K3, K1]


@pytest.mark.parametrize(("content", "error"), [
    (b"{", "not JSON"),
    (b"[]", "expected an object"),
    (json.dumps({"primary": E1, "keys": [E1], "extra": 1}).encode(), "unknown field 'extra'"),
    (json.dumps({"primary": E1}).encode(), '"keys" must be a list'),
    (json.dumps({"primary": E1, "keys": E1}).encode(), '"keys" must be a list'),
    (json.dumps({"primary": E1, "keys": [1]}).encode(), '"keys" must be a list'),
    (json.dumps({"primary": E1, "keys": []}).encode(), '"keys" is empty'),
    (json.dumps({"keys": [E1]}).encode(), '"primary" must be a base64 string'),
    (json.dumps({"primary": E1, "keys": [E1, "not base64!"]}).encode(), r"keys\[1\]: a key is base64"),
    (json.dumps({"primary": E1, "keys": [base64.b64encode(b"short").decode()]}).encode(), r"keys\[0\]: a key is 16"),
    (json.dumps({"primary": "@@", "keys": [E1]}).encode(), "primary: a key is base64"),
    (json.dumps({"primary": E2, "keys": [E1]}).encode(), 'primary key is not in "keys"'),
    (b'{"primary": "\xff"}', "not UTF-8"),
])
def test_validation_errors_name_the_file(tmp_path: Path, content: bytes, error: str) -> None:
    path = tmp_path / "keyring.json"
    path.write_bytes(content)
    with pytest.raises(KeyringFileError, match=f"keyring file {path}: .*{error}"):
        load_keyring(path)


def test_missing_and_oversized_files(tmp_path: Path) -> None:
    with pytest.raises(KeyringFileError, match=f"keyring file {tmp_path / 'none.json'}: No such file"):
        load_keyring(tmp_path / "none.json")
    big = tmp_path / "big.json"
    big.write_text(" " * 70_000)
    with pytest.raises(KeyringFileError, match="over 65536 bytes"):
        load_keyring(big)


def test_apply_keys_install_use_remove() -> None:
    ring = Keyring(K1, [K2])
    assert apply_keys(ring, K3, [K3, K1]) == [f"installed {_fp(K3)}", f"using {_fp(K3)}", f"removed {_fp(K2)}"]
    assert ring.keys() == [K3, K1]
    assert apply_keys(ring, K3, [K3, K1]) == []


def _fp(key: bytes) -> str:
    from region_agent.gossip.keyfile import fingerprint

    return fingerprint(key)


def problem_of(watcher: KeyringWatcher) -> str:
    return watcher.problem or ""


def test_watcher_keeps_keys_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    save_keyring(path, Keyring(K1))
    ring = load_keyring(path)
    watcher = KeyringWatcher(path, ring, poll=0.01)
    assert not watcher.check()  # first read: nothing to change
    assert watcher.problem is None
    path.write_text('{"primary": "')  # a half-written file
    assert not watcher.check()
    assert str(path) in problem_of(watcher)
    assert ring.keys() == [K1]
    path.unlink()
    assert not watcher.check()
    assert "No such file" in problem_of(watcher)
    save_keyring(path, Keyring(K2, [K1]))
    assert watcher.check()
    assert not watcher.problem
    assert ring.keys() == [K2, K1]
    assert not watcher.check()


def test_watcher_problems_name_the_refused_file(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    save_keyring(path, Keyring(K1))
    watcher = KeyringWatcher(path, load_keyring(path))
    assert not watcher.check() and watcher.problems() == ()
    path.write_text("{}")
    assert not watcher.check()
    assert watcher.problems() == (f"gossip keyring file refused, keeping the current keys: {watcher.problem}",)
    assert str(path) in problem_of(watcher)
    save_keyring(path, Keyring(K2, [K1]))
    assert watcher.check() and watcher.problems() == ()


class Counter:
    def __init__(self) -> None:
        self.got: set[bytes] = set()

    def receive_packet(self, data: bytes, source: Address) -> None:
        self.got.add(data)

    def receive_stream(self, data: bytes, source: Address) -> None:
        self.got.add(data)


async def test_rotation_through_files_loses_no_datagram(tmp_path: Path) -> None:
    """Two agents, each with its own keyring file and watcher; datagrams both ways throughout."""
    files = [tmp_path / "a.json", tmp_path / "b.json"]
    for path in files:
        save_keyring(path, Keyring(K1))
    rings = [load_keyring(path) for path in files]
    watchers = [KeyringWatcher(path, ring, poll=0.02) for path, ring in zip(files, rings, strict=True)]
    transports = [await GossipTransport.start(f"127.0.0.{i + 2}", 0, rings[i], GossipStats()) for i in range(2)]
    counters = [Counter(), Counter()]
    for transport, counter in zip(transports, counters, strict=True):
        transport.attach(counter)
    tasks = [asyncio.create_task(w.run()) for w in watchers]
    sent: list[set[bytes]] = [set(), set()]
    stop = asyncio.Event()

    async def traffic() -> None:
        n = 0
        while not stop.is_set():
            for i in (0, 1):
                data = b"%d-%d" % (i, n)
                transports[i].send_packet(transports[1 - i].addr, data)
                sent[i].add(data)
            n += 1
            await asyncio.sleep(0.005)

    def all_arrived() -> bool:
        return counters[1].got >= sent[0] and counters[0].got >= sent[1]

    async def step(action: str, key: bytes, on: list[int], check: Callable[[Keyring], bool]) -> None:
        before = len(sent[0])
        for i in on:
            edit_keyring(files[i], action, encode_key(key))
        await wait_for(lambda: all(check(rings[i]) for i in on), timeout=5, message=f"{action} applied")
        await wait_for(lambda: len(sent[0]) > before + 20, timeout=5, message="traffic after the step")

    sender = asyncio.create_task(traffic())
    try:
        await wait_for(lambda: len(sent[0]) > 20, timeout=5, message="traffic")
        await step("install", K2, [0, 1], lambda r: r.keys().count(K2) == 1)
        await step("use", K2, [0], lambda r: r.primary == K2)  # a sends with K2, b still with K1
        await step("use", K2, [1], lambda r: r.primary == K2)
        await step("remove", K1, [0, 1], lambda r: r.keys() == [K2])
        stop.set()
        await sender
        await wait_for(all_arrived, timeout=5, message="every datagram delivered")
        assert all(t.stats.rejected.total() == 0 for t in transports)
        assert all(w.problem is None and w.reloads == 3 for w in watchers)
        assert json.loads(dump_keyring(rings[1])) == {"primary": encode_key(K2), "keys": [encode_key(K2)]}
    finally:
        stop.set()
        for task in [*tasks, sender]:
            task.cancel()
        for transport in transports:
            await transport.close()
