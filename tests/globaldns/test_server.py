"""The DNS server over real UDP and TCP sockets on loopback, queried with dnspython."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import AsyncIterator

import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rrset
import pytest

from region_agent.globaldns import server as server_module
from region_agent.globaldns.answer import Responder, ResponderLimits
from region_agent.globaldns.compiler import ZoneConfig, compile_zone
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.server import BindError, DnsServer, TcpLimits
from region_agent.globaldns.tables import ZoneHolder
from region_agent.state.model import CopyHealth, Mode, Project, Region
from tests.conftest import wait_for
from tests.fakes.dns_client import ask, ask_with_fallback, frame, make_query, query_wire, read_message
from tests.globaldns.zones import ALL, ZONE, PrefixLocator, ha, proximity, store_with, tables_for, up


def _tables() -> object:
    store = store_with([ha("shop")], {("shop", r): up(r)[r] for r in ALL})
    big = Region("lax1", ipv4=tuple(f"10.1.{i // 200}.{i % 200 + 1}" for i in range(120)))
    store.put(("region", "lax1"), big)
    store.put(("project", "big"), Project("big", ("lax1",), mode=Mode.HA))
    store.put(("copy", "big", "lax1"), CopyHealth(True))
    return compile_zone(store.snapshot(), ZoneConfig(ZONE))


@pytest.fixture
async def server() -> AsyncIterator[DnsServer]:
    holder = ZoneHolder(_tables())  # type: ignore[arg-type]
    srv = DnsServer(Responder(holder, DnsCounters()), [("127.0.0.1", 0)], TcpLimits(idle_timeout=0.3,
                                                                                   max_connections=3))
    await srv.start()
    yield srv
    await srv.stop()


def _port(srv: DnsServer) -> int:
    return srv.bound[0][1]


async def test_udp_answer(server: DnsServer) -> None:
    response = await ask(_port(server), f"shop.{ZONE}")
    assert response.rcode() == dns.rcode.NOERROR
    assert {r.to_text() for r in response.answer[0]} == {"192.0.2.11"}


async def test_truncation_then_tcp_retry(server: DnsServer) -> None:
    query = make_query(f"big.{ZONE}", use_edns=False)
    udp = await ask(_port(server), query)
    assert udp.flags & dns.flags.TC and not udp.answer
    response, used_tcp = await ask_with_fallback(_port(server), query)
    assert used_tcp
    assert len(response.answer[0]) == 120


async def _tcp_exchange(port: int, messages: list[bytes], *, split: bool = False) -> list[dns.message.Message]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = b"".join(frame(m) for m in messages)
    if split:  # one byte at a time: framing must not depend on segment boundaries
        for i in range(len(payload)):
            writer.write(payload[i:i + 1])
            await writer.drain()
    else:
        writer.write(payload)  # pipelined: all queries before any answer
    responses = [await read_message(reader) for _ in messages]
    writer.close()
    return responses


async def test_pipelined_tcp_queries(server: DnsServer) -> None:
    queries = [query_wire(name, qid=qid) for qid, name in ((11, f"shop.{ZONE}"), (12, f"nope.{ZONE}"),
                                                          (13, "example.org"))]
    responses = await _tcp_exchange(_port(server), queries)
    assert {r.id: r.rcode() for r in responses} == {11: dns.rcode.NOERROR, 12: dns.rcode.NXDOMAIN,
                                                    13: dns.rcode.REFUSED}


async def test_tcp_framing_split_into_single_bytes(server: DnsServer) -> None:
    (response,) = await _tcp_exchange(_port(server), [query_wire(f"big.{ZONE}")], split=True)
    assert len(response.answer[0]) == 120


async def _udp_raw(port: int, payload: bytes, timeout: float = 0.5) -> bytes | None:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, payload)
        try:
            return await asyncio.wait_for(loop.sock_recv(sock, 65535), timeout)
        except TimeoutError:
            return None
    finally:
        sock.close()


async def test_formerr_on_garbage_and_the_server_keeps_answering(server: DnsServer) -> None:
    out = await _udp_raw(_port(server), b"\xab\xcd\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xff\xff\xff")
    assert out is not None
    response = dns.message.from_wire(out)
    assert response.id == 0xABCD and response.rcode() == dns.rcode.FORMERR
    assert await _udp_raw(_port(server), b"\x01\x02\x03", timeout=0.2) is None  # too short to answer
    await test_udp_answer(server)


async def test_garbage_on_tcp_closes_the_connection(server: DnsServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"\x00\x03abc")
    assert await asyncio.wait_for(reader.read(), 2) == b""
    writer.close()


async def test_badvers(server: DnsServer) -> None:
    response = await ask(_port(server), make_query(f"shop.{ZONE}", use_edns=1))
    assert response.rcode() == dns.rcode.BADVERS
    assert response.edns == 0


async def test_ecs_is_echoed_with_a_scope(server: DnsServer) -> None:
    response = await ask(_port(server), make_query(f"shop.{ZONE}", ecs=("203.0.113.0", 24)))
    (ecs,) = [o for o in response.options if isinstance(o, dns.edns.ECSOption)]
    assert (ecs.address, ecs.srclen, ecs.scopelen) == ("203.0.113.0", 24, 0)


async def test_idle_tcp_connections_are_closed(server: DnsServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    assert await asyncio.wait_for(reader.read(), 3) == b""  # closed by the 0.3 s idle timeout
    writer.close()
    await wait_for(lambda: not server.connections, timeout=2, message="connection forgotten")


async def test_a_connection_beyond_the_limit_is_served_and_the_longest_idle_closed(server: DnsServer) -> None:
    held = [await asyncio.open_connection("127.0.0.1", _port(server)) for _ in range(3)]
    await wait_for(lambda: len(server.connections) == 3, timeout=2, message="three connections")
    (response,) = await _tcp_exchange(_port(server), [query_wire(f"shop.{ZONE}")])
    assert response.rcode() == dns.rcode.NOERROR
    assert await asyncio.wait_for(held[0][0].read(), 2) == b""
    assert server.responder.counters.tcp_closed["evicted"] == 1
    for _, w in held:
        w.close()


async def test_ipv6_listener() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        probe = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("::1 is not configured")
    srv = DnsServer(Responder(ZoneHolder(_tables()), DnsCounters()), [("::1", 0)])  # type: ignore[arg-type]
    await srv.start()
    try:
        response = await ask(srv.bound[0][1], f"shop.{ZONE}", "AAAA", host="::1")
        assert {r.to_text() for r in response.answer[0]} == {"2001:db8::11"}
    finally:
        await srv.stop()


async def test_a_port_taken_for_tcp_fails_start_and_leaves_udp_unbound() -> None:
    """A configured port binds UDP and TCP together or not at all (port 0 picks again instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = DnsServer(Responder(ZoneHolder(_tables()), DnsCounters()), [("127.0.0.1", port)])  # type: ignore[arg-type]
        with pytest.raises(BindError) as caught:
            await srv.start()
        assert str(caught.value).startswith(f"dns.port: can not listen on 127.0.0.1 port {port}/tcp: address already")
        assert srv.bound == []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", port))  # the UDP half was released


SQUATTERS = [(socket.SO_REUSEADDR, "127.0.0.1"), (socket.SO_REUSEADDR, "0.0.0.0"), (socket.SO_REUSEPORT, "127.0.0.1")]
SQUATTER_IDS = ["SO_REUSEADDR same address", "SO_REUSEADDR wildcard", "SO_REUSEPORT same address"]


@pytest.mark.parametrize(("option", "address"), SQUATTERS, ids=SQUATTER_IDS)
async def test_udp_socket_is_not_shared_with_a_squatter(server: DnsServer, option: int, address: str) -> None:
    """No SO_REUSEADDR on UDP: another process can not bind the port beside us and take our queries."""
    (udp,) = server._udp
    assert udp.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, option, 1)
        with pytest.raises(OSError) as caught:
            squatter.bind((address, _port(server)))
        assert caught.value.errno == errno.EADDRINUSE


@pytest.mark.parametrize(("option", "address"), SQUATTERS, ids=SQUATTER_IDS)
async def test_start_beside_a_udp_squatter_fails_naming_the_port_setting(option: int, address: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, option, 1)
        squatter.bind((address, 0))
        port = squatter.getsockname()[1]
        srv = DnsServer(Responder(ZoneHolder(_tables()), DnsCounters()), [("127.0.0.1", port)])  # type: ignore[arg-type]
        with pytest.raises(BindError) as caught:
            await srv.start()
        assert (caught.value.setting, caught.value.errno) == ("dns.port", errno.EADDRINUSE)
        assert srv.bound == []


async def test_an_address_not_on_this_host_fails_naming_the_address_setting() -> None:
    srv = DnsServer(Responder(ZoneHolder(_tables()), DnsCounters()), [("192.0.2.1", 0)])  # type: ignore[arg-type]
    with pytest.raises(BindError) as caught:
        await srv.start()
    assert str(caught.value) == ("dns.listen_addresses: can not listen on 192.0.2.1 port 0/udp: address not "
                                 "available on this host")


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
async def test_zone_transfers_are_refused(server: DnsServer, tcp: bool) -> None:
    axfr = make_query(ZONE, "AXFR", use_edns=0)
    ixfr = make_query(ZONE, "IXFR", use_edns=0)  # with the client's SOA in authority (RFC 1995 §3)
    ixfr.authority.append(dns.rrset.from_text(f"{ZONE}.", 0, "IN", "SOA", f"ns1.{ZONE}. h.{ZONE}. 1 3600 600 86400 60"))
    for query in (axfr, ixfr):
        response = await ask(_port(server), query, tcp=tcp)
        assert response.rcode() == dns.rcode.REFUSED, query.question
        assert response.edns == 0


@pytest.fixture(params=["recvmmsg", "recvfrom"])
async def either_reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[DnsServer]:
    """The server with the batched reader (Linux) and with the portable one (recvfrom until EAGAIN)."""
    if request.param == "recvfrom":
        monkeypatch.setattr(server_module, "_MMSG", None)
    elif server_module._MMSG is None:
        pytest.skip("no recvmmsg here")
    srv = DnsServer(Responder(ZoneHolder(_tables()), DnsCounters()), [("127.0.0.1", 0)])  # type: ignore[arg-type]
    await srv.start()
    yield srv
    await srv.stop()


async def test_both_udp_readers_answer_hits_misses_and_garbage_alike(either_reader: DnsServer) -> None:
    port = _port(either_reader)
    for name in (f"shop.{ZONE}", f"ShOp.{ZONE}", f"shop.{ZONE}", f"nothing.{ZONE}"):
        response = await ask(port, name)
        expected = dns.rcode.NXDOMAIN if name.startswith("nothing") else dns.rcode.NOERROR
        assert response.rcode() == expected and response.question[0].name.to_text() == f"{name}."
    counters = either_reader.responder.counters
    assert counters.memo_hits >= 1  # the second and third asked the memo
    formerr = await asyncio.to_thread(_raw_udp, port, b"\x12\x34" + bytes(10) + b"\xc0")  # a question cut short
    assert formerr[:2] == b"\x12\x34" and formerr[3] & 0x0F == dns.rcode.FORMERR
    assert sum(counters.latency_counts) >= 1  # the batches were timed


async def test_a_burst_read_in_one_batch_answers_each_query_as_rendering_does(either_reader: DnsServer) -> None:
    """Hits are answered in place and misses copied in; datagrams that get no answer (responses)
    in between move the later answers and their addresses down a slot."""
    port = _port(either_reader)
    for _ in range(2):  # the second query promotes the entry out of probation: later ones are hits
        await ask(port, f"shop.{ZONE}")
    reference = Responder(either_reader.responder.holder, DnsCounters(), ResponderLimits(memo_entries=0))  # renders
    response = make_query(f"shop.{ZONE}").to_wire()
    response = response[:2] + bytes((response[2] | 0x80,)) + response[3:]  # QR set: never answered
    burst = [response]
    for qid, name in enumerate((f"shop.{ZONE}", f"SHOP.{ZONE}", f"nothing.{ZONE}", f"shop.{ZONE}", f"ShOp.{ZONE}")):
        query = make_query(name)
        query.id = qid + 1
        burst += [query.to_wire(), response]
    burst.append(b"\x00\x63" + bytes(10) + b"\xc0")  # a question cut short: FORMERR
    expected = {wire[:2]: reference.respond(wire, "127.0.0.1", tcp=False) for wire in burst}
    expected = {qid: out for qid, out in expected.items() if out is not None}
    hits = either_reader.responder.counters.memo_hits
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        for wire in burst:  # all sent before the loop runs the listener: one read of the socket gets them
            sock.sendto(wire, ("127.0.0.1", port))
        loop = asyncio.get_running_loop()
        answers: dict[bytes, bytes] = {}
        while len(answers) < len(expected):
            out = await asyncio.wait_for(loop.sock_recv(sock, 4096), 2.0)
            answers[out[:2]] = out
    assert answers == expected
    assert either_reader.responder.counters.memo_hits == hits + 4


def _raw_udp(port: int, data: bytes) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2.0)
        sock.sendto(data, ("127.0.0.1", port))
        return sock.recv(4096)


async def test_an_answer_that_raises_costs_that_query_only_and_is_logged_at_most_every_10_s(
        either_reader: DnsServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    port = _port(either_reader)
    responder = either_reader.responder
    real = responder._respond

    def failing(data: bytes, *args: object, **kwargs: object) -> bytes | None:
        if b"boom" in data:
            raise RuntimeError("a bug in the answer path")
        return real(data, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(responder, "_respond", failing)
    monkeypatch.setattr(server_module, "ANSWER_ERRORS", server_module.AnswerErrors())
    caplog.set_level("ERROR", logger="region_agent.dns")
    for _ in range(5):
        with pytest.raises(dns.exception.Timeout):
            await ask(port, f"boom.{ZONE}", timeout=0.2)
    assert (await ask(port, f"shop.{ZONE}")).rcode() == dns.rcode.NOERROR  # the listener goes on
    assert responder.counters.answer_errors == 5
    lines = [r for r in caplog.records if "error answering a UDP query" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is not None  # one traceback, not five


@pytest.mark.parametrize("reader", ["recvmmsg", "recvfrom"])
async def test_a_proximity_answer_over_udp_reads_the_senders_address(reader: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener converts the sender's address only when read (answer.Source): a proximity name
    without ECS is answered for the datagram's own source, one with ECS for the subnet."""
    if reader == "recvfrom":
        monkeypatch.setattr(server_module, "_MMSG", None)
    elif server_module._MMSG is None:
        pytest.skip("no recvmmsg here")
    locator = PrefixLocator({"127.0.0.0/8": (["ams1", "sfo1", "nrt1"], 8),
                             "203.0.113.0/24": (["nrt1", "sfo1", "ams1"], 24)})
    tables = tables_for([proximity("blog")], {"blog": up(*ALL)}, locator=locator)
    srv = DnsServer(Responder(ZoneHolder(tables), DnsCounters()), [("127.0.0.1", 0)])
    await srv.start()
    try:
        for ecs, expected in ((None, {"192.0.2.12"}), (("203.0.113.0", 24), {"192.0.2.13"}), (None, {"192.0.2.12"})):
            options: list[dns.edns.Option] = [] if ecs is None else [dns.edns.ECSOption(*ecs)]
            query = dns.message.make_query(f"blog.{ZONE}", "A", use_edns=0, options=options)
            response = await ask(_port(srv), query)
            assert {r.to_text() for r in response.answer[0]} == expected
        assert locator.calls == 3
    finally:
        await srv.stop()
