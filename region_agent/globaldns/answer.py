"""The answer path: query → :class:`Reply` (pure lookup) → wire bytes.

:func:`answer` is the whole decision and touches no socket; :func:`render` turns a reply
into a response no larger than the transport allows (RFC 1035 §4.2.1, RFC 6891 §7,
RFC 2181 §9: additional records are dropped first and silently, otherwise TC is set and
the answer and authority sections are left out). :class:`Responder` adds the case-blind
memo of rendered responses per table generation (``region_agent.globaldns.memo``), so a repeated query
costs a key, a dict lookup and a splice of its ID and question, and the optional response
rate limiter for UDP (``region_agent.globaldns.rrl``).
"""

from __future__ import annotations

import ipaddress
import mmap
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from region_agent.globaldns.memo import Entry, ResponseMemo, memo_key, memoisable
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.rrl import DROP, ERROR, PASS, RESPONSE, SLIP, RateLimiter
from region_agent.globaldns.rrl import NXDOMAIN as RRL_NXDOMAIN
from region_agent.globaldns.tables import REFUSED_REPLY, Reply, ZoneHolder, ZoneTables
from region_agent.globaldns.wire import (
    ANY,
    AXFR,
    BADVERS,
    CD,
    CLASS_IN,
    IXFR,
    MIN_UDP_PAYLOAD,
    NOERROR,
    NOTAUTH,
    NXDOMAIN,
    OPCODE_MASK,
    QR,
    RD,
    SERVFAIL,
    TC,
    MessageError,
    Query,
    error_response,
    opt_record,
    parse_query,
)

TCP_MAX = 65535
BADVERS_REPLY = Reply(BADVERS, aa=False)
SERVFAIL_REPLY = Reply(SERVFAIL, aa=False)
ZONE_TRANSFERS = (AXFR, IXFR)


Source = str | Callable[[], str] | None
"""The query's sender address as text, or how to get it: the UDP listener hands a function, so the
address is converted only when something reads it (a proximity answer, the rate limiter, an UPDATE)."""


def source_text(source: Source) -> str | None:
    return source() if callable(source) else source


def client_address(query: Query, source: Source) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """Whom the answer is for: the EDNS Client Subnet if present, else the packet's source."""
    if query.edns is not None and query.edns.client_subnet is not None:
        return query.edns.client_subnet.ip  # None when the client asked that no address be used
    source = source_text(source)
    if source is None:
        return None
    address = ipaddress.ip_address(source.partition("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def answer(tables: ZoneTables, query: Query, source: Source = None) -> Reply:
    """Decide the reply to a parsed query from the compiled tables."""
    if query.edns is not None and query.edns.version != 0:
        return BADVERS_REPLY
    if query.qclass != CLASS_IN:
        return REFUSED_REPLY
    qtype = query.qtype
    node = tables.nodes.get(query.qname_lower)
    if node is not None:
        reply = node.replies.get(qtype)
        if reply is not None:
            return reply
        chooser = node.dynamic.get(qtype)
        if chooser is not None:
            return chooser.reply(client_address(query, source))
        if qtype == ANY:
            return node.any_reply
        if qtype in ZONE_TRANSFERS:
            return REFUSED_REPLY
        return tables.negative(NOERROR, 12 + len(query.qname_lower) - len(tables.apex))
    apex_offset = tables.apex_offset(query.qname_lower)
    if apex_offset is None or qtype in ZONE_TRANSFERS:
        return REFUSED_REPLY
    if query.qname_lower in tables.empty_nonterminals:
        return tables.negative(NOERROR, apex_offset)
    return tables.negative(NXDOMAIN, apex_offset)


def max_response_size(query: Query, *, tcp: bool, our_payload: int) -> int:
    if tcp:
        return TCP_MAX
    if query.edns is None:
        return MIN_UDP_PAYLOAD
    return max(MIN_UDP_PAYLOAD, min(query.edns.payload, our_payload))


_HEADER = struct.Struct("!HHHHHH")
_COPIED_FLAGS = OPCODE_MASK | RD | CD  # what wire.response_flags copies from the query
_PLAIN_OPTS: dict[tuple[int, int, bool], bytes] = {}  # (our payload, rcode, DO) → OPT without options


def _plain_opt(our_payload: int, rcode: int, do: bool) -> bytes:
    """An OPT record without options; a handful exist (one payload, two DO values, few rcodes)."""
    key = (our_payload, rcode, do)
    opt = _PLAIN_OPTS.get(key)
    if opt is None:
        opt = _PLAIN_OPTS[key] = opt_record(our_payload, extended_rcode=rcode, do=do)
    return opt


def render(query: Query, reply: Reply, *, max_size: int, our_payload: int) -> bytes:
    """The response; every query that is not a memo hit comes through here, so it calls little.

    Flags as ``wire.response_flags``: QR, opcode/RD/CD copied, AA when authoritative.
    """
    edns = query.edns
    rcode = reply.rcode
    if edns is None:
        opt = b""
    elif edns.client_subnet is None:
        opt = _PLAIN_OPTS.get((our_payload, rcode, edns.do)) or _plain_opt(our_payload, rcode, edns.do)
    else:
        echoes = edns.echoes
        if echoes is None:
            echoes = edns.echoes = {}
        echo = echoes.get((our_payload, rcode, reply.scope))  # a handful: rcodes × scopes of its answers
        if echo is None:
            echo = echoes[(our_payload, rcode, reply.scope)] = opt_record(
                our_payload, extended_rcode=rcode, do=edns.do, options=edns.client_subnet.option(reply.scope))
        opt = echo
    question = query.question
    body = reply.body
    flags = QR | (query.flags & _COPIED_FLAGS) | reply.flag_bits
    if 12 + len(question) + len(body) + len(opt) <= max_size:
        return b"".join((_HEADER.pack(query.id, flags, 1, reply.answer.count, reply.authority.count,
                                      reply.additional.count + (1 if opt else 0)), question, body, opt))
    # Too large: additional records go first, then TC with the answer and authority left out.
    answer_data, authority_data = reply.answer.data, reply.authority.data
    an, ns = reply.answer.count, reply.authority.count
    if 12 + len(question) + len(answer_data) + len(authority_data) + len(opt) > max_size:
        answer_data, authority_data, an, ns = b"", b"", 0, 0
        flags |= TC
    return b"".join((_HEADER.pack(query.id, flags, 1, an, ns, 1 if opt else 0), question, answer_data,
                     authority_data, opt))


@dataclass
class ResponderLimits:
    our_payload: int = 1232  # DNS Flag Day 2020; RFC 9715 says at most 1400
    memo_entries: int = 20_000  # rendered responses kept per table generation
    latency_sample: int = 16  # time one query in this many for the latency histogram (a power of two)


# Answers for names that exist: a flood of random names (NXDOMAIN, REFUSED outside the zone,
# BADVERS) must not fill the memo, and their bucket in the rate limiter is the zone, not the name.
MEMOISED_RCODES = frozenset({NOERROR, SERVFAIL})


AnswerLater = Callable[[bytes], None]
"""Sends the answer to one query when it is ready: UDP to its sender, TCP on its connection (RFC 7766 §6.2.1.1
lets answers on one connection come out of order). ``later`` (below) makes one for the query being answered
now, and only while it is being answered."""


class UpdateHandler(Protocol):
    """RFC 2136 UPDATEs and TSIG-signed queries (``region_agent.globaldns.acme.service``).

    A handler that can not answer at once (a dns worker forwarding to the main process) calls ``later``,
    returns None, and sends the answer through what ``later`` gave it; a handler that answers at once
    ignores ``later``. Without ``later`` (None) the answer must be returned.
    """

    def __call__(self, data: bytes, source: str | None, *, tcp: bool = ..., our_payload: int = ...,
                 later: Callable[[], AnswerLater] | None = ...) -> bytes | None:
        ...


class Responder:
    """Wire in, wire out, for both transports; counts what it answers.

    Returns None when nothing is to be sent (a message not worth answering, or a UDP response
    the rate limiter drops). The memo and the limiter are described in ``region_agent.globaldns.memo`` and
    ``region_agent.globaldns.rrl``; TCP is never rate limited.
    """

    def __init__(self, holder: ZoneHolder, counters: DnsCounters, limits: ResponderLimits | None = None,
                 rrl: RateLimiter | None = None) -> None:
        self.holder = holder
        self.counters = counters
        self.limits = limits or ResponderLimits()
        self.rrl = rrl
        self._memo_on = self.limits.memo_entries > 0  # off: not even another Responder's memo is read
        # RFC 2136 UPDATE (opcode 5), when ACME challenges are on (``region_agent.globaldns.acme.service``); else NOTIMP
        # TSIG-signed queries go there too (answered and signed with the query's key, RFC 8945 §5.3).
        self.updates: UpdateHandler | None = None
        self._sample_mask = max(1, self.limits.latency_sample) - 1
        self._queries = 0

    def respond(self, data: bytes, source: str | None, *, tcp: bool,
                later: Callable[[], AnswerLater] | None = None) -> bytes | None:
        """The response to ``data`` (None: nothing to send now; see :class:`UpdateHandler` for ``later``)."""
        self._queries = queries = self._queries + 1
        started = 0.0 if queries & self._sample_mask else time.perf_counter()
        tables = self.holder.tables
        if tables is None:
            return self._unready(data, tcp=tcp)
        memo = (tables.tcp_response_memo if tcp else tables.response_memo) if self._memo_on else None
        if memo is not None and (end := data.find(0, 12)) > 0:  # a name without its zero octet: malformed
            key = data[2:end].lower() + data[end:]  # memo_key and the splice below, inlined: the hot path
            entry = memo.main.get(key) or memo.promote(key)
            if entry is not None:
                entry.hot = True
                if self.rrl is not None and not tcp and source is not None:
                    action = self.rrl.check(source, entry.limit_class, entry.name, entry.qtype)
                    self.counters.rrl_actions[action] += 1
                    if action != PASS:
                        return self._limited(action, data, source, tables)
                counters = self.counters
                counters.memo_hits += 1
                counters.answers[entry.counted] += 1
                response = b"".join((data[:2], entry.head, data[12:entry.qend], entry.tail))
                if started:
                    counters.observe(time.perf_counter() - started)
                return response
        out = self._respond(data, source, tcp, tables, later)
        if started:
            self.counters.observe(time.perf_counter() - started)
        return out

    def udp_hitter(self) -> Callable[[mmap.mmap, int, int], int] | None:
        """For one batch of UDP datagrams: a function answering a query from the memo in place, or
        declining (then :meth:`udp_miss` answers it); None when no query can be a hit now.

        ``hit(buffer, start, length)`` reads the query at ``buffer[start:start + length]``; on a hit
        it overwrites the query with the response and returns the response's size, else it returns 0
        and leaves the bytes alone. In place, because a hit's response is the query's own ID and
        question with the entry's header and tail around them: two writes, no join and no copy.

        What ``respond`` does for a memo hit, minus what a UDP listener knows it need not: no rate
        limiter (with one, every query goes through ``udp_miss``), no source address (only the
        limiter and the miss path read it), no latency sample (the listener times the batch), and
        the tables, the memo and the counters looked up once per batch. A batch is answered in one
        go, so the tables can not change under it.
        """
        tables = self.holder.tables
        if tables is None or self.rrl is not None or not self._memo_on or tables.response_memo is None:
            return None
        memo = tables.response_memo
        main_get, promote = memo.main.get, memo.promote
        counters = self.counters
        answers = counters.answers

        def hit(buffer: mmap.mmap, start: int, length: int) -> int:
            key = buffer[start + 2:start + length]  # the query after its ID
            if not key.islower():  # an upper-case octet (or no letter at all): fold the name's case
                end = key.find(0, 10)  # the name's zero octet (the name starts at offset 10 of the key)
                if end < 0:
                    return 0
                key = key[:end].lower() + key[end:]  # memo_key, inlined: the hot path
            # else lower() would change no octet, so the bytes are their own memo key: no find, no fold
            entry = main_get(key) or promote(key)
            if entry is None:
                return 0
            entry.hot = True
            counters.memo_hits += 1
            answers[entry.counted] += 1
            buffer[start + 2:start + 12] = entry.head  # the ID stays, and the question (its case) after the header
            qend, tail = entry.qend, entry.tail
            size = qend + len(tail)  # a key that matched is as long as the entry's query, which holds the question
            buffer[start + qend:start + size] = tail
            return size

        return hit

    def udp_miss(self, data: bytes, source: Source, later: Callable[[], AnswerLater] | None = None) -> bytes | None:
        """``respond`` for a UDP query the hitter (:meth:`udp_hitter`) did not answer, untimed (the
        listener times the batch); it looks at the memo only when there is a rate limiter."""
        if self.rrl is not None:
            return self.respond(data, source_text(source), tcp=False, later=later)
        tables = self.holder.tables
        if tables is None:
            return self._unready(data, tcp=False)
        return self._respond(data, source, False, tables, later)

    def _respond(self, data: bytes, source: Source, tcp: bool, tables: ZoneTables,
                 later: Callable[[], AnswerLater] | None = None) -> bytes | None:
        """Everything but a memo hit: parse, answer, rate-limit, render, maybe memoise."""
        if self.rrl is not None or self.updates is not None:
            source = source_text(source)  # they read it, so it is converted now
        if self.updates is not None and len(data) > 2 and data[2] & 0x78 == 0x28:  # opcode 5: UPDATE
            return self.updates(data, source_text(source), tcp=tcp, our_payload=self.limits.our_payload,
                                later=later)
        try:
            query = parse_query(data, tables.nodes)
        except MessageError as error:
            if error.rcode == NOTAUTH and self.updates is not None:  # the parser's answer to a TSIG-signed query
                return self.updates(data, source_text(source), tcp=tcp, our_payload=self.limits.our_payload,
                                    later=later)
            self.counters.malformed(error.reason)
            out = error_response(error, our_payload=self.limits.our_payload)
            if out is None:
                return None
            if self.rrl is not None and not tcp and (text := source_text(source)) is not None:
                action = self.rrl.check(text, ERROR)
                self.counters.rrl_actions[action] += 1
                if action == DROP:
                    return None
                if action == SLIP:
                    out = out[:2] + bytes((out[2] | TC >> 8,)) + out[3:]
            self.counters.answers[(-1, error.rcode or 0)] += 1
            return out
        reply = answer(tables, query, source)
        rcode = reply.rcode
        if self.rrl is not None and not tcp and (text := source_text(source)) is not None:
            if rcode == NOERROR:
                action = self.rrl.check(text, RESPONSE, query.qname_lower, query.qtype)
            elif rcode == NXDOMAIN:
                action = self.rrl.check(text, RRL_NXDOMAIN, tables.apex)
            else:
                action = self.rrl.check(text, ERROR)
            self.counters.rrl_actions[action] += 1
            if action == DROP:
                return None
            if action == SLIP:
                self.counters.answers[(query.qtype, rcode)] += 1
                return render(query, reply, max_size=0, our_payload=self.limits.our_payload)
        our_payload = self.limits.our_payload
        edns = query.edns
        # max_response_size, inlined: the miss path (an Edns payload is at least MIN_UDP_PAYLOAD)
        max_size = (TCP_MAX if tcp else MIN_UDP_PAYLOAD if edns is None
                    else edns.payload if edns.payload < our_payload else max(our_payload, MIN_UDP_PAYLOAD))
        out = render(query, reply, max_size=max_size, our_payload=our_payload)
        capacity = self.limits.memo_entries
        if capacity and rcode in MEMOISED_RCODES and not reply.client_dependent and memoisable(data):
            memo = tables.tcp_response_memo if tcp else tables.response_memo
            if memo is None:
                memo = ResponseMemo(capacity)
                if tcp:
                    tables.tcp_response_memo = memo
                else:
                    tables.response_memo = memo
            memo.put(memo_key(data), Entry(out, len(query.question), query.qtype, rcode, query.qname_lower,
                                           RESPONSE if rcode == NOERROR else ERROR))
        self.counters.answers[(query.qtype, rcode)] += 1
        return out

    def _limited(self, action: int, data: bytes, source: str, tables: ZoneTables) -> bytes | None:
        """A rate-limited memo hit: nothing, or the TC=1 reply (rendered afresh: it is rare)."""
        if action == DROP:
            return None
        query = parse_query(data)  # it matched a memo entry, so it parses
        reply = answer(tables, query, source)
        self.counters.answers[(query.qtype, reply.rcode)] += 1
        return render(query, reply, max_size=0, our_payload=self.limits.our_payload)

    def _unready(self, data: bytes, *, tcp: bool) -> bytes | None:
        """Before the first zone is compiled every query gets SERVFAIL (never a guess)."""
        try:
            query = parse_query(data)
        except MessageError as error:
            return error_response(error, our_payload=self.limits.our_payload)
        self.counters.answers[(query.qtype, SERVFAIL)] += 1
        max_size = max_response_size(query, tcp=tcp, our_payload=self.limits.our_payload)
        return render(query, SERVFAIL_REPLY, max_size=max_size, our_payload=self.limits.our_payload)
