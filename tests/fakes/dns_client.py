"""The one DNS client of the tests: ask a server over UDP or TCP, sign with TSIG, build query wire.

* :func:`ask` sends a query (a name, a dnspython message, or exact bytes) and returns the parsed
  answer; :func:`exchange` returns the answer's wire as well; :func:`try_ask` and :func:`answers`
  return ``None`` instead of raising while a server is not up yet (for polling with ``wait_for``).
  No answer within ``timeout`` raises :class:`dns.exception.Timeout`, as dnspython does.
* A dnspython message is answered as dnspython's own client would read it: the reply to a
  TSIG-signed query is verified with the query's key. Exact bytes are answered without checking a
  TSIG (a stale or unsigned UPDATE gets an unsigned or unverifiable error back).
* :func:`make_query` and :func:`query_wire` build queries with the fields tests vary (ID, flags,
  EDNS, ECS); :func:`frame`, :func:`read_frame` and :func:`read_message` are RFC 1035 §4.2.2 TCP framing, for tests
  that talk to a TCP listener byte by byte.
* :class:`TsigKey`, :func:`signed` and :func:`txt_update` make RFC 2136 UPDATEs as cert-manager
  sends them.

Tests that speak broken protocol on purpose (garbage datagrams, half-open or trickling TCP,
spoofed source addresses) keep their raw sockets and may use the wire builders.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, TypedDict, TypeVar, Unpack

import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.tsig
import dns.tsigkeyring
import dns.update

LOOPBACK = "127.0.0.1"
TIMEOUT = 2.0

Query = dns.message.Message | bytes
M = TypeVar("M", bound=dns.message.Message)


# ---------------------------------------------------------------- building queries


def make_query(
    name: str,
    rdtype: str = "A",
    *,
    qid: int | None = None,
    rdclass: str = "IN",
    use_edns: int | bool | None = None,
    payload: int | None = None,
    want_dnssec: bool = False,
    ecs: tuple[str, int] | None = None,
    flags: int = dns.flags.RD,
) -> dns.message.QueryMessage:
    """A query as :func:`dns.message.make_query` builds it; ``ecs`` is (address, source prefix length).

    EDNS is off unless ``use_edns``, ``payload``, ``want_dnssec`` or ``ecs`` asks for it (dnspython's
    rule); ``use_edns=False`` keeps it off whatever else is given.
    """
    options: list[dns.edns.Option] | None = [dns.edns.ECSOption(ecs[0], ecs[1])] if ecs is not None else None
    return dns.message.make_query(name, rdtype, rdclass=rdclass, use_edns=use_edns, payload=payload,
                                  want_dnssec=want_dnssec, options=options, id=qid, flags=flags)


class QueryFields(TypedDict, total=False):
    """:func:`make_query`'s keyword arguments."""

    qid: int | None
    rdclass: str
    use_edns: int | bool | None
    payload: int | None
    want_dnssec: bool
    ecs: tuple[str, int] | None
    flags: int


def query_wire(name: str, rdtype: str = "A", **fields: Unpack[QueryFields]) -> bytes:
    """The wire of :func:`make_query`'s query, for tests that hand bytes to a responder or a socket."""
    return make_query(name, rdtype, **fields).to_wire()


def frame(wire: bytes) -> bytes:
    """One DNS message as it goes over TCP: a two-byte length, then the message."""
    return struct.pack("!H", len(wire)) + wire


async def read_frame(reader: asyncio.StreamReader, timeout: float = TIMEOUT) -> bytes:
    """The next length-prefixed message from a TCP stream (the wire, without the length)."""
    async with _deadline(timeout):
        (length,) = struct.unpack("!H", await reader.readexactly(2))
        return await reader.readexactly(length)


async def read_message(reader: asyncio.StreamReader, timeout: float = TIMEOUT) -> dns.message.Message:
    """The next message from a TCP stream, parsed."""
    return dns.message.from_wire(await read_frame(reader, timeout))


# ---------------------------------------------------------------- asking a server


@dataclass(frozen=True)
class Reply:
    message: dns.message.Message
    wire: bytes


async def exchange(port: int, query: Query, *, host: str = LOOPBACK, tcp: bool = False,
                   timeout: float = TIMEOUT) -> Reply:
    """Send one query and read its answer: the parsed message and the bytes it came in."""
    wire = query if isinstance(query, bytes) else query.to_wire()
    reply = await (_tcp_exchange if tcp else _udp_exchange)(host, port, wire, timeout)
    if isinstance(query, bytes):
        return Reply(dns.message.from_wire(reply, keyring=False), reply)
    return Reply(dns.message.from_wire(reply, keyring=query.keyring, request_mac=query.mac), reply)


async def ask(port: int, query: str | Query, rdtype: str = "A", *, host: str = LOOPBACK, tcp: bool = False,
              timeout: float = TIMEOUT) -> dns.message.Message:
    """The answer to ``query``: a name (asked for ``rdtype``), a dnspython message, or exact bytes."""
    message = make_query(query, rdtype) if isinstance(query, str) else query
    return (await exchange(port, message, host=host, tcp=tcp, timeout=timeout)).message


async def ask_with_fallback(port: int, query: dns.message.Message, *, host: str = LOOPBACK,
                            timeout: float = TIMEOUT) -> tuple[dns.message.Message, bool]:
    """Over UDP, and again over TCP when the UDP answer is truncated: (answer, whether TCP was used)."""
    response = await ask(port, query, host=host, timeout=timeout)
    if not response.flags & dns.flags.TC:
        return response, False
    return await ask(port, query, host=host, tcp=True, timeout=timeout), True


async def try_ask(port: int, query: str | Query, rdtype: str = "A", *, host: str = LOOPBACK, tcp: bool = False,
                  timeout: float = TIMEOUT) -> dns.message.Message | None:
    """:func:`ask`, or ``None`` when nothing answers in time or the socket fails (a server not up yet)."""
    try:
        return await ask(port, query, rdtype, host=host, tcp=tcp, timeout=timeout)
    except (dns.exception.DNSException, OSError, EOFError):
        return None


async def answers(port: int, query: str | Query, rdtype: str = "A", *, host: str = LOOPBACK, tcp: bool = False,
                  timeout: float = TIMEOUT) -> set[str] | None:
    """The answer section's rdata as text (:func:`rdata_texts`), or ``None`` as for :func:`try_ask`."""
    response = await try_ask(port, query, rdtype, host=host, tcp=tcp, timeout=timeout)
    return None if response is None else rdata_texts(response)


def rdata_texts(response: dns.message.Message) -> set[str]:
    """Every rdata of the answer section as text: addresses for A/AAAA, quoted strings for TXT."""
    return {rdata.to_text() for rrset in response.answer for rdata in rrset}


def txt_values(response: dns.message.Message) -> set[str]:
    """The TXT strings of the answer section, unquoted and joined per record."""
    return {b"".join(rdata.strings).decode() for rrset in response.answer for rdata in rrset}


# ---------------------------------------------------------------- TSIG and UPDATE


@dataclass(frozen=True)
class TsigKey:
    name: str
    secret: str  # base64, as in a Kubernetes Secret or nsupdate -y
    algorithm: dns.name.Name = dns.tsig.HMAC_SHA256

    def keyring(self) -> dict[dns.name.Name, dns.tsig.Key]:
        return dns.tsigkeyring.from_text({self.name: (self.algorithm, self.secret)})


def signed(message: M, key: TsigKey, *, fudge: int = 300) -> M:
    """``message`` signed with ``key`` (the signature is made when it is turned into wire)."""
    message.use_tsig(key.keyring(), keyname=key.name, fudge=fudge, algorithm=key.algorithm)
    return message


def txt_update(zone: str, owner: str, action: Literal["add", "delete"], value: str, *,
               ttl: int = 60) -> dns.update.UpdateMessage:
    """What cert-manager's RFC 2136 solver sends: add the TXT with TTL 60, or delete that one value
    (an RR with class NONE), unsigned until :func:`signed`."""
    update = dns.update.UpdateMessage(zone)
    if action == "add":
        update.add(owner, ttl, "TXT", f'"{value}"')
    else:
        update.delete(owner, "TXT", f'"{value}"')
    return update


# ---------------------------------------------------------------- transports


@asynccontextmanager
async def _deadline(timeout: float) -> AsyncIterator[None]:
    """``asyncio.timeout`` raising dnspython's Timeout, as dnspython's own client does."""
    try:
        async with asyncio.timeout(timeout):
            yield
    except TimeoutError:
        raise dns.exception.Timeout(timeout=timeout) from None  # type: ignore[no-untyped-call]


async def _udp_exchange(host: str, port: int, wire: bytes, timeout: float) -> bytes:
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[bytes] = loop.create_future()

    class Client(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: object) -> None:
            # Another query's late answer on a reused client port is not this one's: same ID only.
            if not reply.done() and data[:2] == wire[:2]:
                reply.set_result(data)

        def error_received(self, exc: Exception) -> None:  # ICMP port unreachable: nothing listens
            if not reply.done():
                reply.set_exception(exc)

    transport, _ = await loop.create_datagram_endpoint(Client, remote_addr=(host, port))
    try:
        transport.sendto(wire)
        async with _deadline(timeout):
            return await reply
    finally:
        transport.close()


async def _tcp_exchange(host: str, port: int, wire: bytes, timeout: float) -> bytes:
    async with _deadline(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(frame(wire))
            await writer.drain()
            return await read_frame(reader, timeout)
        finally:
            writer.close()
