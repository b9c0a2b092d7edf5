"""A large store crosses real sockets: 10,000 projects catch up over TCP streams, datagrams stay small."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from region_agent.app.replication import StoreReplica
from region_agent.base.identity import Signer
from region_agent.gossip.keyring import Keyring, generate_key
from region_agent.gossip.node import GossipNode
from region_agent.gossip.settings import GossipSettings
from region_agent.state.hlc import HybridClock
from region_agent.state.model import (
    Certificate,
    CopyHealth,
    Project,
    Region,
    cert_key,
    copy_key,
    project_key,
    region_key,
)
from region_agent.state.signatures import EntryVerifier
from region_agent.state.store import Store
from tests.conftest import wait_for
from tests.fakes.identities import ClusterCA
from tests.fakes.ports import free_port


def _store(writer: str, signer: Signer | None = None, verifier: EntryVerifier | None = None) -> Store:
    return Store(writer=writer, clock=HybridClock(lambda: int(time.time() * 1000)), signer=signer, verifier=verifier)


def _settings(tmp_keyring: str, seeds: list[str]) -> GossipSettings:
    # The nodes here take a Keyring object and no TLS: these tests are about streams and anti-entropy.
    return GossipSettings(enabled=True, bind_address="127.0.0.1", port=free_port(), preset="lan",
                          keyring_file=tmp_keyring, seeds=seeds, sync_interval=0.5, allow_unsigned=True)


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
async def test_ten_thousand_projects_catch_up_over_streams_with_no_datagram_over_the_mtu(  # type: ignore[no-untyped-def]
        tmp_path, signed: bool) -> None:
    """Signed: every one of the 20,002 entries (and the certificate) is checked by the receiver, in a
    worker thread; bench/store_catchup.py times the two side by side."""
    keyring = Keyring(generate_key())
    ring = str(tmp_path / "unused.json")   # the node takes the Keyring object; the path is only validated
    if signed:
        ca = ClusterCA.make()
        sfo = ca.agent("sfo1", "a")
        a_store, b_store = _store("sfo1/a", sfo.signer), _store("ams1/b", verifier=EntryVerifier(ca.book()))
        a_store.put(cert_key("sfo1", Certificate(sfo.der)), Certificate(sfo.der))
    else:
        a_store, b_store = _store("sfo1/a"), _store("ams1/b")
    items: list[tuple[tuple[str, ...], Region | Project]] = [
        (region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",))), (region_key("ams1"), Region("ams1"))]
    items += [(project_key(f"p{i:05d}"), Project(f"p{i:05d}", ("sfo1", "ams1"))) for i in range(10_000)]
    a_store.put_many(items, writer="control/sfo1.a")
    a_store.put_many([(copy_key(f"p{i:05d}", "sfo1"), CopyHealth(True)) for i in range(10_000)])
    a = GossipNode(_settings(ring, []), region="sfo1", node="a", keyring=keyring,
                   replica=StoreReplica(a_store, CollectorRegistry()))
    await a.start()
    assert a.transport is not None
    b = GossipNode(_settings(ring, [f"127.0.0.1:{a.transport.addr.port}"]), region="ams1", node="b",
                   keyring=keyring, replica=StoreReplica(b_store, CollectorRegistry()))
    await b.start()
    sizes: list[int] = []
    for node in (a, b):   # record every datagram's size on its way out, then send it as before
        transport = node.transport
        assert transport is not None
        original = transport.send_packet

        def recording(addr, data, original=original, overhead=transport.overhead):  # type: ignore[no-untyped-def]
            sizes.append(len(data) + overhead)
            original(addr, data)

        transport.send_packet = recording  # type: ignore[method-assign]
    stalls: list[float] = []

    async def watch_the_loop() -> None:   # how late a 5 ms timer fires: what a DNS query would wait
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            stalls.append(time.perf_counter() - before - 0.005)

    tasks = [asyncio.create_task(coro) for coro in (a.run_anti_entropy(), b.run_anti_entropy(), b.run_join(),
                                                    watch_the_loop())]
    started = time.monotonic()
    try:
        await wait_for(lambda: a_store.digest() == b_store.digest(), timeout=60, interval=0.05,
                       message="20,002 entries caught up")
        elapsed = time.monotonic() - started
        assert len(b_store.projects) == 10_000 and len(b_store.copies) == 10_000
        # The store moved over streams; every datagram (sealed) stayed within the path MTU bound.
        assert b.stats.received_bytes["sync"] > 1_000_000
        assert sizes and max(sizes) <= 1400 and a.stats.rejected["too_large"] == 0
        assert elapsed < 30, elapsed
        assert b_store.metrics.rejected.labels("unsigned")._value.get() == 0
        stall = max(stalls) * 1000
        print(f"\n20,002 entries ({'signed' if signed else 'unsigned'}) caught up in {elapsed:.2f} s; sync bytes "
              f"received {b.stats.received_bytes['sync']:,}; longest loop stall {stall:.1f} ms")
        assert stall < 250, stall   # a loose bound for a loaded CI machine; the figures are in the closing note
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await b.stop()
        await a.stop()


async def test_seeds_come_from_the_list_and_from_a_dns_name_never_ourselves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A headless Service is a DNS name whose A records are the agents: `seeds_dns` (here localhost)."""
    from region_agent.gossip.messages import Address

    port = free_port()
    settings = GossipSettings(enabled=True, bind_address="127.0.0.1", port=port, preset="lan",
                              keyring_file=str(tmp_path / "k.json"), seeds=["localhost:7001", "127.0.0.9"],
                              seeds_dns="localhost", allow_unsigned=True)
    node = GossipNode(settings, region="sfo1", node="a", keyring=Keyring(generate_key()),
                      replica=StoreReplica(_store("sfo1/a"), CollectorRegistry()))
    await node.start()
    try:
        seeds = await node.resolve_seeds()
        assert Address("127.0.0.1", 7001) in seeds and Address("127.0.0.9", port) in seeds
        assert Address("127.0.0.1", port) not in seeds   # the DNS name's record that is this agent
    finally:
        await node.stop()
