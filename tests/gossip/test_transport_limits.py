"""The gossip stream listener under hostile clients: what connections can cost is bounded (issue item 6).

Without TLS anyone may connect, and a frame is authenticated only once read whole. Before: 2,000
connections from one address were accepted, and each could make the agent buffer an 8 MiB frame.
Here: a source beyond its share is refused, the longest idle connection gives way when all are
taken, an announced frame that does not fit the buffer budget is refused before it is read, and
silent or slow clients are cut. The agent's own streams keep arriving throughout. Bounds are small
so the tests run fast; each runs on asyncio's loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any

import pytest

from region_agent.gossip.keyring import Keyring
from region_agent.gossip.messages import Address
from region_agent.gossip.settings import GossipSettings
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.transport import GossipTransport, StreamLimits
from tests.conftest import wait_for

KEY = b"k" * 32
KiB = 1024
LIMITS = StreamLimits(max_connections=8, max_per_source=4, timeout=30.0, idle_timeout=30.0,
                      buffer_bytes=1024 * KiB, source_buffer_bytes=600 * KiB)
MAX_STREAM = 256 * KiB
ATTACKERS = ("127.0.0.9", "127.0.0.10", "127.0.0.11")

RUNNERS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run}
with contextlib.suppress(ImportError):  # uvloop is optional off Linux/macOS
    import uvloop

    RUNNERS["uvloop"] = uvloop.run


def both_loops(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    def run(loop: str) -> None:
        RUNNERS[loop](test())

    run.__name__, run.__doc__ = test.__name__, test.__doc__
    return pytest.mark.parametrize("loop", list(RUNNERS))(run)


class Recorder:
    def __init__(self) -> None:
        self.streams: list[bytes] = []

    def receive_packet(self, data: bytes, source: Address) -> None:
        pass

    def receive_stream(self, data: bytes, source: Address) -> None:
        self.streams.append(data)


@contextlib.asynccontextmanager
async def pair(**limits: Any) -> AsyncIterator[tuple[GossipTransport, GossipTransport, Recorder]]:
    """``a`` listens under the test's limits; ``b`` is a peer whose streams (from 127.0.0.1) must arrive."""
    keyring = Keyring(KEY)
    a = await GossipTransport.start("127.0.0.2", 0, keyring, GossipStats(), max_stream=MAX_STREAM,
                                    limits=replace(LIMITS, **limits))
    b = await GossipTransport.start("127.0.0.3", 0, keyring, GossipStats(), max_stream=MAX_STREAM)
    got = Recorder()
    a.attach(got)
    try:
        yield a, b, got
    finally:
        await a.close()
        await b.close()


async def connect(a: GossipTransport, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(a.addr.host, a.addr.port, local_addr=(source, 0))


async def cut(reader: asyncio.StreamReader) -> bool:
    """The agent closed (or reset) this connection."""
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except ConnectionResetError:
        return True


async def delivered(a: GossipTransport, b: GossipTransport, got: Recorder, payload: bytes) -> None:
    b.send_stream(a.addr, payload)
    await wait_for(lambda: payload in got.streams, timeout=10, message=f"the peer's stream {payload!r}")


@both_loops
async def test_a_source_beyond_its_share_is_refused_and_peers_still_get_through() -> None:
    async with pair() as (a, b, got):
        held = [await connect(a, ATTACKERS[0]) for _ in range(4)]
        counters = a.streams.counters
        await wait_for(lambda: counters.open == 4, message="four held")
        reader, _ = await connect(a, ATTACKERS[0])
        assert await cut(reader)
        assert counters.refused["source_limit"] == 1 and counters.open == 4
        await delivered(a, b, got, b"from the peer")
        for _, writer in held:
            writer.close()


@both_loops
async def test_when_all_slots_are_taken_the_longest_idle_gives_way() -> None:
    async with pair() as (a, b, got):
        counters = a.streams.counters
        held = [await connect(a, ATTACKERS[i // 4]) for i in range(8)]
        await wait_for(lambda: counters.open == 8, message="every slot taken")
        # The oldest one sends a frame header: now it is the most recently active, and keeps its slot.
        held[0][1].write(struct.pack(">I", 100))
        await wait_for(lambda: counters.buffered == 100, message="the header read")
        await delivered(a, b, got, b"beside eight idle ones")
        assert counters.closed["evicted"] == 1
        assert await cut(held[1][0])  # the longest idle
        assert not held[0][0].at_eof()
        await wait_for(lambda: counters.open == 7, message="the peer's stream done: seven held")
        for _, writer in held:
            writer.close()


@both_loops
async def test_a_frame_over_the_stream_bound_is_refused_unread() -> None:
    async with pair() as (a, b, got):
        reader, writer = await connect(a, ATTACKERS[0])
        writer.write(struct.pack(">I", 8 * 1024 * KiB))  # the old bound, past this listener's
        assert await cut(reader)
        assert a.stats.rejected["too_large"] == 1 and a.streams.counters.peak_buffered == 0
        await delivered(a, b, got, b"still open")


@both_loops
async def test_announced_frames_beyond_the_buffer_budget_are_refused_before_they_are_read() -> None:
    """A keyless client announces the largest frame on many connections: what is held stays in budget."""
    async with pair(max_per_source=8, max_connections=32) as (a, b, got):
        counters = a.streams.counters
        size = MAX_STREAM  # what the bound allows: each would be held whole before the key is tried
        clients = [await connect(a, source) for source in ATTACKERS for _ in range(4)]
        for _, writer in clients:
            # Sealed-looking (the keyring's version byte first), half of it sent: held open.
            writer.write(struct.pack(">I", size) + b"\x01" + os.urandom(size // 2 - 1))
        await wait_for(lambda: counters.refused["buffer"] + counters.buffered // size == len(clients),
                       message="every announced frame reserved or refused")
        # 600 KiB per source: two frames each; 1 MiB in all: four frames, whoever sent them.
        assert counters.buffered == counters.peak_buffered == 4 * size <= LIMITS.buffer_bytes
        assert counters.refused["buffer"] == len(clients) - 4
        for _, writer in clients:
            if not writer.is_closing():  # the refused ones are reset (uvloop raises on a write then)
                writer.write(os.urandom(size - size // 2))  # complete them: garbage, refused by the key
        await wait_for(lambda: a.stats.rejected["key"] == 4 and counters.buffered == 0, timeout=10,
                       message="the reserved frames read, refused, released")
        for _, writer in clients:
            writer.close()
        await delivered(a, b, got, os.urandom(MAX_STREAM - 1024))  # a peer's largest still fits


@both_loops
async def test_silent_and_slow_clients_are_cut() -> None:
    async with pair(idle_timeout=1.0, timeout=1.5) as (a, b, got):
        counters = a.streams.counters
        silent, _ = await connect(a, ATTACKERS[0])
        assert await cut(silent)
        assert counters.closed["idle"] == 1
        slow, writer = await connect(a, ATTACKERS[1])
        writer.write(struct.pack(">I", MAX_STREAM))  # 4 pieces
        for _ in range(8):  # a 64 KiB piece every 0.5 s: never idle, never whole within 1.5 s (bounded: 4 s)
            if counters.closed["timeout"]:
                break
            writer.write(b"x" * 64 * KiB)
            await asyncio.sleep(0.5)
        assert await cut(slow)
        assert counters.closed["timeout"] == 1 and counters.buffered == 0
        await delivered(a, b, got, b"after the slow ones")


def test_the_settings_defaults_are_the_transport_defaults() -> None:
    assert StreamLimits.from_settings(GossipSettings()) == StreamLimits()
