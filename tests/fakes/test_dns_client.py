"""The tests' DNS client against small servers on loopback: what it returns, and how it fails."""

from __future__ import annotations

import asyncio
import base64
from typing import cast

import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.tsig
import pytest

from tests.fakes.dns_client import (
    TsigKey,
    answers,
    ask,
    exchange,
    frame,
    make_query,
    query_wire,
    read_frame,
    signed,
    try_ask,
    txt_update,
)
from tests.fakes.dns_server import ZONE, udp_only_soa
from tests.fakes.ports import free_port

KEY = TsigKey("test-key", base64.b64encode(b"0123456789abcdef0123456789abcdef").decode())


async def test_udp_asks_and_returns_the_parsed_answer_and_its_wire() -> None:
    async with udp_only_soa() as (server, port):
        reply = await exchange(port, make_query(ZONE, "SOA", qid=4321))
        assert reply.message.id == 4321 and reply.wire[:2] == b"\x10\xe1"
        assert dns.message.from_wire(reply.wire) == reply.message
        assert reply.message.answer[0].rdtype == dns.rdatatype.SOA
        assert await answers(port, ZONE, "SOA") == {f"ns-sfo1.{ZONE}. hostmaster.{ZONE}. 1 3600 600 604800 60"}
        assert server.queries == 2


async def test_nothing_listening_is_an_os_error_or_none() -> None:
    async with udp_only_soa() as (_, port):  # nothing on TCP
        with pytest.raises(ConnectionRefusedError):
            await ask(port, ZONE, "SOA", tcp=True)
        assert await try_ask(port, ZONE, "SOA", tcp=True) is None


class Stray(asyncio.DatagramProtocol):
    """Answers every query twice: first with another ID (a late answer to someone else), then its own."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        response = dns.message.make_response(dns.message.from_wire(data))
        stray = dns.message.make_response(dns.message.from_wire(data))
        stray.id = (response.id + 1) & 0xFFFF
        stray.set_rcode(dns.rcode.SERVFAIL)
        self.transport.sendto(stray.to_wire(), addr)
        self.transport.sendto(response.to_wire(), addr)


async def test_an_answer_with_another_id_is_not_taken_for_this_one() -> None:
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(Stray, local_addr=("127.0.0.1", 0))
    try:
        port = transport.get_extra_info("sockname")[1]
        assert (await ask(port, ZONE)).rcode() == dns.rcode.NOERROR
    finally:
        transport.close()


async def test_no_answer_in_time_is_dnspythons_timeout() -> None:
    silent = await asyncio.get_running_loop().create_datagram_endpoint(asyncio.DatagramProtocol,
                                                                       local_addr=("127.0.0.1", 0))
    try:
        port = silent[0].get_extra_info("sockname")[1]
        with pytest.raises(dns.exception.Timeout):
            await ask(port, ZONE, timeout=0.1)
        assert await try_ask(port, ZONE, timeout=0.1) is None
    finally:
        silent[0].close()


async def _tcp_signing_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A TCP server answering one query with NOERROR, signed with :data:`KEY` whatever the query's key."""
    query = dns.message.from_wire(await read_frame(reader), keyring=False)
    response = dns.message.make_response(query)
    response.use_tsig(KEY.keyring(), keyname=KEY.name, algorithm=KEY.algorithm)
    assert query.mac is not None
    response.request_mac = query.mac
    writer.write(frame(response.to_wire()))
    await writer.drain()
    writer.close()


async def test_tcp_and_tsig_a_signed_answer_is_verified_with_the_querys_key() -> None:
    port = free_port()
    server = await asyncio.start_server(_tcp_signing_server, "127.0.0.1", port)
    try:
        update = signed(txt_update(ZONE, f"_acme-challenge.{ZONE}.", "add", "token"), KEY)
        response = await ask(port, update, tcp=True)
        assert response.rcode() == dns.rcode.NOERROR and response.had_tsig
        other = signed(txt_update(ZONE, f"_acme-challenge.{ZONE}.", "add", "token"),
                       TsigKey(KEY.name, base64.b64encode(b"x" * 32).decode()))
        with pytest.raises(dns.tsig.BadSignature):  # signed with another secret: it does not verify
            await ask(port, other, tcp=True)
    finally:
        server.close()
        await server.wait_closed()


def test_query_wire_sets_what_tests_vary() -> None:
    wire = query_wire("shop.g.example.com", "AAAA", qid=7, use_edns=0, payload=1232, want_dnssec=True,
                      ecs=("192.0.2.0", 24), flags=0)
    query = dns.message.from_wire(wire)
    assert (query.id, query.flags, query.edns, query.payload) == (7, 0, 0, 1232)
    assert query.question[0].rdtype == dns.rdatatype.AAAA and query.ednsflags & dns.flags.DO
    (ecs,) = query.options
    assert isinstance(ecs, dns.edns.ECSOption) and (ecs.address, ecs.srclen) == ("192.0.2.0", 24)
    assert dns.message.from_wire(query_wire("shop.g.example.com")).edns == -1  # no EDNS unless asked
