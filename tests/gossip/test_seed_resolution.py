"""Seeds that do not resolve: one warning per seed per SEED_WARN_INTERVAL and one line when it resolves again;
a cancel that arrives as a lookup ends is not swallowed (Python 3.11's wait_for did), so stop does not wait."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from region_agent.app.replication import StoreReplica
from region_agent.gossip.keyring import Keyring, generate_key
from region_agent.gossip.messages import Address
from region_agent.gossip.node import SEED_WARN_INTERVAL, GossipNode
from region_agent.gossip.settings import GossipSettings
from region_agent.state.hlc import HybridClock
from region_agent.state.store import Store
from tests.conftest import wait_for

Info = tuple[Any, ...]


def _node(tmp_path: Path, seeds: list[str], seeds_dns: str | None = None) -> GossipNode:
    settings = GossipSettings(enabled=True, bind_address="127.0.0.1", port=7946, preset="lan",
                              keyring_file=str(tmp_path / "k.json"), seeds=seeds, seeds_dns=seeds_dns,
                              allow_unsigned=True)
    store = Store(writer="sfo1/a", clock=HybridClock(lambda: int(time.time() * 1000)))
    return GossipNode(settings, region="sfo1", node="a", keyring=Keyring(generate_key()),
                      replica=StoreReplica(store, CollectorRegistry()))


def _info(address: str) -> Info:
    return (socket.AF_INET, socket.SOCK_DGRAM, 17, "", (address, 7946))


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "region_agent.gossip"]


async def test_an_unresolvable_seed_is_warned_about_once_per_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="region_agent.gossip")
    broken = {"seed-a.example", "seeds.example"}

    async def getaddrinfo(host: str, port: int, **_kw: Any) -> list[Info]:
        if host in broken:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [_info("127.0.0.9")]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    node = _node(tmp_path, ["seed-a.example", "seed-b.example"], seeds_dns="seeds.example")
    for _ in range(5):   # five join attempts
        assert await node.resolve_seeds() == [Address("127.0.0.9", 7946)]
    warnings = [m for level, m in _lines(caplog) if level == logging.WARNING]
    assert warnings == [
        "gossip: seed seed-a.example does not resolve: [Errno -2] Name or service not known "
        "(said again at most every 10 min)",
        "gossip: seeds_dns seeds.example does not resolve: [Errno -2] Name or service not known "
        "(said again at most every 10 min)"]
    # SEED_WARN_INTERVAL later, still broken: said once more
    node.seed_warnings = {what: at - SEED_WARN_INTERVAL for what, at in node.seed_warnings.items()}
    await node.resolve_seeds()
    await node.resolve_seeds()
    assert len([m for level, m in _lines(caplog) if level == logging.WARNING]) == 4
    caplog.clear()
    broken.clear()   # the names resolve again: one line each, then nothing
    for _ in range(3):
        await node.resolve_seeds()
    assert _lines(caplog) == [(logging.INFO, "gossip: seed seed-a.example resolves again"),
                              (logging.INFO, "gossip: seeds_dns seeds.example resolves again")]
    assert node.seed_warnings == {}


async def test_a_lookup_that_times_out_is_warned_about_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="region_agent.gossip")

    real_timeout = asyncio.timeout

    def instant(_delay: float | None) -> asyncio.Timeout:   # asyncio.timeout(5.0) expires at once
        return real_timeout(0)

    async def getaddrinfo(host: str, port: int, **_kw: Any) -> list[Info]:
        await asyncio.Event().wait()   # a resolver that never answers
        raise AssertionError("unreachable")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(asyncio, "timeout", instant)   # the module node.py calls it from
    node = _node(tmp_path, ["slow.example"])
    assert await node.resolve_seeds() == [] and await node.resolve_seeds() == []
    assert [m for _, m in _lines(caplog)] == [
        "gossip: seed slow.example does not resolve: no answer within 5 s (said again at most every 10 min)"]


async def test_a_cancel_as_the_lookup_ends_is_not_swallowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup's result and the cancel arrive in one loop iteration, as when stop cancels the join task
    just as getaddrinfo's thread answers: the task must end cancelled, not go on joining."""
    loop = asyncio.get_running_loop()
    answers: list[asyncio.Future[list[Info]]] = []

    def getaddrinfo(host: str, port: int, **_kw: Any) -> asyncio.Future[list[Info]]:
        answers.append(loop.create_future())
        return answers[-1]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    node = _node(tmp_path, ["seed-a.example", "seed-b.example"])
    task = asyncio.create_task(node.resolve_seeds())
    await wait_for(lambda: answers, message="the first lookup")
    answers[0].set_result([_info("127.0.0.9")])   # the lookup is done ...
    task.cancel()                                 # ... and the cancel arrives before the task runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and len(answers) == 1   # the second seed was never looked up
