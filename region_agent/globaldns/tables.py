"""Compiled answer tables: immutable, swapped whole, so answering is a lookup.

The zone compiler builds a new :class:`ZoneTables` whenever the state changes and hands it
to the :class:`ZoneHolder`; the server reads ``holder.tables`` once per query. Nothing in
a table changes after it is built except its memo of rendered responses, which belongs to
that generation and is dropped with it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from region_agent.globaldns.memo import ResponseMemo
from region_agent.globaldns.records import EMPTY, Section
from region_agent.globaldns.wire import AA, NOERROR, NXDOMAIN, REFUSED


@dataclass(frozen=True, slots=True)
class Reply:
    """What to answer, before it becomes wire bytes for one query."""

    rcode: int
    aa: bool
    answer: Section = EMPTY
    authority: Section = EMPTY
    additional: Section = EMPTY
    scope: int = 0  # ECS scope prefix length: how widely the answer holds
    client_dependent: bool = False  # depends on the client's address (proximity)
    # Made once from the fields above, for render: the three sections' bytes back to back, and
    # the header's rcode and AA bits.
    body: bytes = field(init=False, repr=False, compare=False)
    flag_bits: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "body", self.answer.data + self.authority.data + self.additional.data)
        object.__setattr__(self, "flag_bits", (self.rcode & 0xF) | (AA if self.aa else 0))


REFUSED_REPLY = Reply(REFUSED, aa=False)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Locator(Protocol):
    """GeoIP proximity: the closest candidate and the ECS scope over which it holds."""

    def choose(self, address: IPAddress, candidates: frozenset[str]) -> tuple[str | None, int]: ...


@dataclass(frozen=True, slots=True)
class ProximityAnswer:
    """A proximity project's answer for one address family, chosen per client."""

    by_region: Mapping[str, Reply]  # region → its healthy addresses
    candidates: frozenset[str]  # healthy regions with a location
    unlocated: Reply  # every healthy address, for a client with no location
    locator: Locator | None

    def reply(self, client: IPAddress | None) -> Reply:
        if client is None or self.locator is None or not self.candidates:
            return self.unlocated
        region, scope = self.locator.choose(client, self.candidates)
        if region is None:
            return _with_scope(self.unlocated, scope)
        return _with_scope(self.by_region[region], scope)


def _with_scope(reply: Reply, scope: int) -> Reply:
    return Reply(reply.rcode, reply.aa, reply.answer, reply.authority, reply.additional, scope, True)


@dataclass(frozen=True, slots=True)
class Node:
    """Everything answered for one owner name (other types: NODATA from ``ZoneTables.negative``).

    A node never holds the SOA, so a new serial does not touch it and compiled project nodes
    are reused from one zone generation to the next.
    """

    replies: Mapping[int, Reply]  # qtype → fixed reply
    dynamic: Mapping[int, ProximityAnswer]  # qtype → reply chosen per client
    any_reply: Reply


@dataclass(frozen=True, slots=True)
class CompiledProject:
    owner: bytes
    node: Node
    description: dict[str, object]


@dataclass(slots=True)
class ZoneTables:
    apex: bytes  # lower-case wire form
    serial: int
    nodes: Mapping[bytes, Node]
    empty_nonterminals: frozenset[bytes]
    negative: Callable[[int, int], Reply]  # (rcode, apex offset) → NXDOMAIN / NODATA with SOA
    infrastructure: tuple[dict[str, object], ...] = ()  # apex and name servers, for `region-agent zone`
    projects: Mapping[str, CompiledProject] = field(default_factory=dict)
    basis: object = None  # what every compiled project depends on besides its own records
    # rendered responses of this generation (region_agent.globaldns.memo), UDP and TCP, made by the
    # Responder on first use
    response_memo: ResponseMemo | None = None
    tcp_response_memo: ResponseMemo | None = None
    challenge_owners: frozenset[bytes] = frozenset()  # names holding ACME challenge TXT records

    @property
    def description(self) -> list[dict[str, object]]:
        return [*self.infrastructure, *(self.projects[slug].description for slug in sorted(self.projects))]

    def apex_offset(self, qname_lower: bytes) -> int | None:
        """Offset of the apex inside a query name at offset 12, or None when out of zone."""
        apex = self.apex
        if not qname_lower.endswith(apex):
            return None
        boundary = len(qname_lower) - len(apex)
        i = 0
        while i < boundary:
            i += qname_lower[i] + 1
        return 12 + boundary if i == boundary else None


class ZoneHolder:
    """The current tables; replaced whole by the compiler, read by the server."""

    def __init__(self, tables: ZoneTables | None = None) -> None:
        self.tables = tables

    def replace(self, tables: ZoneTables) -> None:
        self.tables = tables

    def clear(self) -> None:
        """No tables: every query is answered SERVFAIL (a withheld zone)."""
        self.tables = None


def negative_reply_factory(soa_for_offset: Callable[[int], Section]) -> Callable[[int, int], Reply]:
    """NXDOMAIN/NODATA replies with the SOA in authority, memoised per apex offset."""
    memo: dict[tuple[int, int], Reply] = {}

    def negative(rcode: int, apex_offset: int) -> Reply:
        key = (rcode, apex_offset)
        reply = memo.get(key)
        if reply is None:
            reply = Reply(rcode, aa=True, authority=soa_for_offset(apex_offset))
            memo[key] = reply
        return reply

    return negative


__all__ = [
    "NOERROR",
    "NXDOMAIN",
    "REFUSED_REPLY",
    "CompiledProject",
    "Locator",
    "Node",
    "ProximityAnswer",
    "Reply",
    "ZoneHolder",
    "ZoneTables",
    "negative_reply_factory",
]
