"""DNS over TCP under hostile clients: what one connection may cost is bounded (issue 7).

Each test reproduces one way a client abused the server on loopback — never reading its
answers, trickling bytes, holding every slot, sending garbage after a good query — and
shows the bound that now holds. Limits are small so that the tests run fast; nothing here
asserts timing (``bench/dns_tcp_abuse.py`` measures memory and UDP latency under abuse).
Each test runs on asyncio's loop and on uvloop: flow control and buffered reads are each
loop's own code, so a bound that holds on one is not known to hold on the other.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import dns.rcode
import pytest

from region_agent.base.sockets import source_key
from region_agent.globaldns.answer import Responder
from region_agent.globaldns.compiler import ZoneConfig, compile_zone
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.server import DnsServer, TcpLimits, TcpProtocol
from region_agent.globaldns.tables import ZoneHolder, ZoneTables
from region_agent.state.model import CopyHealth, Mode, Project, Region
from tests.conftest import wait_for
from tests.fakes.dns_client import ask, frame, query_wire, read_message
from tests.globaldns.zones import ALL, ZONE, ha, store_with, up

LIMITS = TcpLimits(idle_timeout=30.0, message_timeout=30.0, max_connections=8, max_per_source=4,
                   write_buffer=4096, max_in_flight=8)
READ_CHUNK = 16 * 1024  # region_agent.globaldns.server reads at most this much at a time

RUNNERS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run}
try:
    import uvloop

    RUNNERS["uvloop"] = uvloop.run
except ImportError:  # uvloop is optional off Linux/macOS
    pass


def both_loops(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    """Run the async ``test`` once on each event loop the agent may use."""
    def run(loop: str) -> None:
        RUNNERS[loop](test())

    run.__name__, run.__doc__ = test.__name__, test.__doc__
    return pytest.mark.parametrize("loop", list(RUNNERS))(run)


def _tables() -> ZoneTables:
    store = store_with([ha("shop")], {("shop", r): up(r)[r] for r in ALL})
    store.put(("region", "lax1"), Region("lax1", ipv4=tuple(f"10.1.{i // 200}.{i % 200 + 1}" for i in range(120))))
    store.put(("project", "big"), Project("big", ("lax1",), mode=Mode.HA))
    store.put(("copy", "big", "lax1"), CopyHealth(True))
    return compile_zone(store.snapshot(), ZoneConfig(ZONE))


@asynccontextmanager
async def serving(**limits: Any) -> AsyncIterator[DnsServer]:
    server = DnsServer(Responder(ZoneHolder(_tables()), DnsCounters()), [("127.0.0.1", 0)],
                       replace(LIMITS, **limits))
    await server.start()
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(), 5)  # never held up by a client that does not read


def _port(server: DnsServer) -> int:
    return server.bound[0][1]


async def _connect(server: DnsServer, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", _port(server), local_addr=(source, 0))


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        return True


async def _udp_answers(server: DnsServer) -> bool:
    response = await ask(_port(server), f"shop.{ZONE}")
    return bool(response.rcode() == dns.rcode.NOERROR and response.answer)


async def _trickle(writer: asyncio.StreamWriter, data: bytes, interval: float) -> None:
    """The abusive client: one byte, then a pause, and so on (a slowloris for DNS)."""
    for i in range(len(data)):
        if writer.is_closing():
            return
        writer.write(data[i:i + 1])
        await asyncio.sleep(interval)


async def _small_buffered_client(server: DnsServer) -> tuple[socket.socket, TcpProtocol]:
    """A raw client socket whose connection has small kernel buffers on both ends.

    Loopback kernel buffers hold megabytes; made small, what fills up is the agent's own buffer.
    """
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", _port(server)))
    def accepted() -> TcpProtocol | None:
        return next(iter(server.connections), None)

    connection = await wait_for(accepted, message="the connection accepted")
    assert connection is not None and connection.transport is not None
    connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return client, connection


# --- a client that never reads ------------------------------------------------------------


@both_loops
async def test_a_client_that_never_reads_is_paused_with_its_unsent_answers_bounded() -> None:
    async with serving(write_buffer=4096, max_in_flight=8) as server:
        loop = asyncio.get_running_loop()
        client, connection = await _small_buffered_client(server)
        assert connection.transport is not None
        query = frame(query_wire(f"big.{ZONE}", qid=1))
        answer_size = len(server.responder.respond(query[2:], "127.0.0.1", tcp=True) or b"") + 2
        sending = asyncio.create_task(loop.sock_sendall(client, query * 3000))  # asks for ~6 MB of answers
        counters = server.responder.counters
        try:
            await wait_for(lambda: counters.tcp_read_pauses["write_buffer"] >= 1, message="reading paused")
            answered = sum(counters.answers.values())
            assert await _udp_answers(server)  # the loop still serves everyone else
            assert not connection.reading
            # Unsent answers: the bound, plus at most the one batch whose write crossed it.
            assert connection.transport.get_write_buffer_size() <= 4096 + 8 * answer_size
            assert len(connection.buffer) <= READ_CHUNK + len(query)  # unanswered queries: one read at most
            assert sum(counters.answers.values()) == answered + 1  # only the UDP query: the pipe is not read
            assert answered < 3000
        finally:
            sending.cancel()
        # Shutdown does not wait for answers nobody reads: the connection is aborted.
    client.close()
    assert counters.tcp_closed["shutdown"] == 1


@both_loops
async def test_a_slow_reader_gets_every_answer_in_order() -> None:
    """Backpressure pauses and resumes; it never loses or reorders an answer."""
    async with serving(write_buffer=1024, max_in_flight=4) as server:
        loop = asyncio.get_running_loop()
        client, connection = await _small_buffered_client(server)
        await loop.sock_sendall(client, b"".join(frame(query_wire(f"big.{ZONE}", qid=qid)) for qid in range(300)))
        counters = server.responder.counters
        await wait_for(lambda: counters.tcp_read_pauses["write_buffer"] >= 1, message="reading paused")
        assert not connection.reading
        received = bytearray()
        ids: list[int] = []
        while len(ids) < 300:  # ~2 KB each; only the IDs are looked at (dnspython would take seconds)
            chunk = await asyncio.wait_for(loop.sock_recv(client, 65536), 5)
            assert chunk, "closed early"
            received += chunk
            while len(received) >= 4 and len(received) >= 2 + struct.unpack_from("!H", received)[0]:
                ids.append(struct.unpack_from("!H", received, 2)[0])
                del received[:2 + struct.unpack_from("!H", received)[0]]
        assert ids == list(range(300))
        assert counters.tcp_read_pauses["write_buffer"] >= 2  # it resumed, and filled up again
        client.close()


@both_loops
async def test_pipelined_queries_are_answered_a_batch_per_loop_turn() -> None:
    async with serving(write_buffer=1 << 20, max_in_flight=4) as server:
        reader, writer = await _connect(server)
        writer.write(b"".join(frame(query_wire(f"shop.{ZONE}", qid=qid)) for qid in range(40)))  # one segment
        ids = [(await read_message(reader, 5)).id for _ in range(40)]
        assert ids == list(range(40))
        assert server.responder.counters.tcp_read_pauses["in_flight"] >= 1
        writer.close()


@both_loops
async def test_half_close_after_pipelined_queries_gets_all_answers_then_the_close() -> None:
    async with serving(max_in_flight=3) as server:
        reader, writer = await _connect(server)
        writer.write(b"".join(frame(query_wire(f"shop.{ZONE}", qid=qid)) for qid in range(20)))
        writer.write_eof()
        ids = [(await read_message(reader, 5)).id for _ in range(20)]
        assert ids == list(range(20))
        assert await _closed_by_server(reader)
        await wait_for(lambda: not server.connections, message="the slot given back")
        assert server.responder.counters.tcp_closed["client"] == 1
        writer.close()


# --- a bad message after good ones -------------------------------------------------------------


@both_loops
async def test_answers_computed_before_a_bad_message_are_written_then_the_connection_closes() -> None:
    async with serving() as server:
        reader, writer = await _connect(server)
        good = frame(query_wire(f"shop.{ZONE}", qid=7)) + frame(query_wire(f"nope.{ZONE}", qid=8))
        writer.write(good + b"\x00\x03abc")
        first, second = await read_message(reader, 5), await read_message(reader, 5)
        assert (first.id, first.rcode(), second.id, second.rcode()) == (7, dns.rcode.NOERROR, 8, dns.rcode.NXDOMAIN)
        assert await _closed_by_server(reader)
        assert server.responder.counters.tcp_closed["bad_message"] == 1
        writer.close()


# --- tricklers ---------------------------------------------------------------------------------


@both_loops
async def test_a_trickler_is_closed_by_the_message_deadline() -> None:
    async with serving(idle_timeout=30.0, message_timeout=0.3) as server:
        reader, writer = await _connect(server)
        trickle = asyncio.create_task(_trickle(writer, frame(b"\x00" * 300), interval=0.02))
        try:
            assert await _closed_by_server(reader)
        finally:
            trickle.cancel()
        assert server.responder.counters.tcp_closed["message_timeout"] == 1
        writer.close()


@both_loops
async def test_a_trickle_does_not_restart_the_idle_timer() -> None:
    """Idle is measured from the last complete message: bytes of an unfinished one do not count."""
    async with serving(idle_timeout=0.5, message_timeout=30.0) as server:
        reader, writer = await _connect(server)
        writer.write(frame(query_wire(f"shop.{ZONE}", qid=3)))
        assert (await read_message(reader, 5)).id == 3
        trickle = asyncio.create_task(_trickle(writer, frame(b"\x00" * 300), interval=0.02))
        try:
            assert await _closed_by_server(reader)
        finally:
            trickle.cancel()
        assert server.responder.counters.tcp_closed["idle"] == 1
        writer.close()


@both_loops
async def test_trickled_bytes_leave_the_deadline_where_it_was() -> None:
    async with serving(idle_timeout=30.0, message_timeout=30.0) as server:
        reader, writer = await _connect(server)
        writer.write(frame(query_wire(f"shop.{ZONE}", qid=4)))
        assert (await read_message(reader, 5)).id == 4
        (connection,) = server.connections
        timer, deadline = connection.timer, connection.deadline
        trickle = asyncio.create_task(_trickle(writer, frame(b"\x00" * 300), interval=0.01))
        try:
            await wait_for(lambda: len(connection.buffer) >= 5, message="five trickled bytes")
        finally:
            trickle.cancel()
        assert connection.timer is timer and connection.deadline == deadline
        writer.close()


@both_loops
async def test_tricklers_holding_every_slot_do_not_lock_out_a_normal_query() -> None:
    async with serving(max_connections=4, max_per_source=2) as server:
        tricklers = [await _connect(server, f"127.0.0.{2 + i // 2}") for i in range(4)]
        for _, writer in tricklers:
            writer.write(b"\x00")  # a message started and never finished
        await wait_for(lambda: len(server.connections) == 4 and all(c.message_started for c in server.connections),
                       message="every slot held by a trickler")
        reader, writer = await _connect(server, "127.0.0.9")
        writer.write(frame(query_wire(f"shop.{ZONE}", qid=5)))
        response = await read_message(reader, 5)
        assert (response.id, response.rcode()) == (5, dns.rcode.NOERROR)
        assert await _closed_by_server(tricklers[0][0])  # the longest idle made room
        assert server.responder.counters.tcp_closed["evicted"] == 1
        assert len(server.connections) == 4
        for _, w in [*tricklers, (reader, writer)]:
            w.close()


@both_loops
async def test_the_least_recently_active_connection_is_the_one_evicted() -> None:
    async with serving(max_connections=3, max_per_source=3) as server:
        clients = [await _connect(server, f"127.0.0.{2 + i}") for i in range(3)]
        await wait_for(lambda: len(server.connections) == 3, message="three connections")
        reader, writer = clients[0]
        writer.write(frame(query_wire(f"shop.{ZONE}", qid=1)))  # the oldest becomes the most recently active
        await read_message(reader, 5)
        newcomer = await _connect(server, "127.0.0.9")
        assert await _closed_by_server(clients[1][0])
        writer.write(frame(query_wire(f"shop.{ZONE}", qid=2)))
        assert (await read_message(reader, 5)).id == 2  # still open
        for _, w in [*clients, newcomer]:
            w.close()


@both_loops
async def test_a_source_at_its_limit_is_refused_and_evicts_nobody() -> None:
    async with serving(max_connections=4, max_per_source=2) as server:
        held = [await _connect(server, source) for source in ("127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3")]
        await wait_for(lambda: len(server.connections) == 4, message="four connections")
        reader, writer = await _connect(server, "127.0.0.2")
        assert await _closed_by_server(reader)
        counters = server.responder.counters
        assert counters.tcp_refused["source_limit"] == 1
        assert counters.tcp_closed["evicted"] == 0
        assert len(server.connections) == 4
        for _, w in [*held, (reader, writer)]:
            w.close()
        await wait_for(lambda: not server.connections, message="every slot given back")
        assert server.per_source == {}


def test_an_ipv6_source_is_its_64() -> None:
    assert source_key("2001:db8:1:2:3:4:5:6") == source_key("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert source_key("192.0.2.1") == "192.0.2.1"
