"""The hand-written query parser against dnspython, malformed input, and fuzzing."""

from __future__ import annotations

import functools
import ipaddress
import random
import struct

import dns.edns
import dns.message
import dns.opcode
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from region_agent.globaldns import wire as wire_module
from region_agent.globaldns.answer import Responder, ResponderLimits
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.tables import ZoneHolder
from region_agent.globaldns.wire import FORMERR, NOTAUTH, NOTIMP, MessageError, name_from_text, parse_query
from tests.globaldns.zones import ALL, ZONE, ha, tables_for, up


def _random_case(name: str, rng: random.Random) -> str:
    return "".join(c.upper() if rng.random() < 0.5 else c for c in name)


@functools.cache
def _valid_queries() -> list[dns.message.QueryMessage]:
    rng = random.Random(7)
    out = []
    for i in range(200):
        name = _random_case(rng.choice([f"shop.{ZONE}", ZONE, "example.org", f"a-b.c.{ZONE}"]), rng)
        qtype = rng.choice(["A", "AAAA", "NS", "SOA", "ANY", "TXT", "MX", "TYPE65280"])
        options: list[dns.edns.Option] = []
        if i % 3 == 0:
            options.append(dns.edns.ECSOption("203.0.113.77", rng.choice([0, 8, 20, 24, 32])))
        if i % 5 == 0:
            options.append(dns.edns.ECSOption("2001:db8:1234::1", rng.choice([0, 48, 56, 64, 128])))
        if i % 4 == 0:
            cookie = bytes(rng.randrange(256) for _ in range(8))
            options.append(dns.edns.GenericOption(dns.edns.OptionType.COOKIE, cookie))
        use_edns = i % 7 != 0
        if not use_edns:
            options = []
        options = options[:1] if sum(o.otype == 8 for o in options) > 1 else options
        query = dns.message.make_query(name, qtype, use_edns=use_edns, payload=rng.choice([512, 1232, 4096, 100]),
                                       want_dnssec=use_edns and i % 2 == 0, options=options)
        query.id = rng.randrange(65536)
        out.append(query)
    return out


def _mutated(data: st.DataObject, least: int, most: int, kinds: tuple[str, ...]) -> bytes:
    """One of the valid queries with ``least``..``most`` edits: a flipped octet, a cut, an insert, or
    (``case``) a letter's case flipped."""
    queries = _valid_queries()
    base = bytearray(queries[data.draw(st.integers(0, len(queries) - 1))].to_wire())
    for _ in range(data.draw(st.integers(least, most))):
        kind = data.draw(st.sampled_from(kinds))
        position = data.draw(st.integers(0, len(base)))
        if kind == "flip" and position < len(base):
            base[position] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del base[position:]
        elif kind == "case":
            if position < len(base) and chr(base[position]).isalpha():
                base[position] ^= 0x20
        else:
            base[position:position] = data.draw(st.binary(min_size=1, max_size=4))
    return bytes(base)


@pytest.mark.parametrize("query", _valid_queries())
def test_parser_agrees_with_dnspython(query: dns.message.QueryMessage) -> None:
    parsed = parse_query(query.to_wire())
    assert parsed.id == query.id
    wire_name = query.question[0].name.to_wire()
    assert wire_name is not None
    assert parsed.qname == wire_name  # case kept
    assert parsed.qname_lower == wire_name.lower()
    assert parsed.qtype == query.question[0].rdtype
    assert (parsed.edns is not None) == (query.edns >= 0)
    if parsed.edns is not None:
        assert parsed.edns.payload == max(512, query.payload)
        assert parsed.edns.do == bool(query.ednsflags & 0x8000)
        ecs = [o for o in query.options if isinstance(o, dns.edns.ECSOption)]
        if ecs:
            assert parsed.edns.client_subnet is not None
            assert parsed.edns.client_subnet.source_prefix == ecs[0].srclen
            if ecs[0].srclen:
                network = ipaddress.ip_network(f"{ecs[0].address}/{ecs[0].srclen}", strict=False)
                assert parsed.edns.client_subnet.ip == network.network_address
        else:
            assert parsed.edns.client_subnet is None


def _header(qid: int = 0x1234, flags: int = 0x0100, qd: int = 1, an: int = 0, ns: int = 0, ar: int = 0) -> bytes:
    return struct.pack("!HHHHHH", qid, flags, qd, an, ns, ar)


QUESTION = b"\x04shop\x01g\x07example\x03com\x00\x00\x01\x00\x01"


def _opt(options: bytes = b"", payload: int = 1232, ttl: int = 0) -> bytes:
    return b"\x00" + struct.pack("!HHIH", 41, payload, ttl, len(options)) + options


def _ecs(family: int, source: int, scope: int, address: bytes) -> bytes:
    data = struct.pack("!HBB", family, source, scope) + address
    return struct.pack("!HH", 8, len(data)) + data


MALFORMED = [
    ("empty", b"", None),
    ("short header", b"\x12\x34\x01", None),
    ("a response", _header(flags=0x8100) + QUESTION, None),
    ("no question", _header(qd=0), FORMERR),
    ("two questions", _header(qd=2) + QUESTION + QUESTION, FORMERR),
    ("truncated question", _header() + QUESTION[:-2], FORMERR),
    ("label past the end", _header() + b"\x3fabc", FORMERR),
    ("compressed question", _header() + b"\xc0\x0c\x00\x01\x00\x01", FORMERR),
    ("extended label type", _header() + b"\x41abc\x00\x00\x01\x00\x01", FORMERR),
    ("name longer than 255", _header() + b"\x3f" + b"a" * 63 + b"\x3f" + b"b" * 63 + b"\x3f" + b"c" * 63
     + b"\x3f" + b"d" * 63 + b"\x00\x00\x01\x00\x01", FORMERR),
    ("answer records in a query", _header(an=1) + QUESTION, FORMERR),
    ("trailing junk", _header() + QUESTION + b"\x00", FORMERR),
    ("additional count too high", _header(ar=1) + QUESTION, FORMERR),
    ("two OPT records", _header(ar=2) + QUESTION + _opt() + _opt(), FORMERR),
    ("OPT not at the root", _header(ar=1) + QUESTION + b"\x01a\x00" + struct.pack("!HHIH", 41, 1232, 0, 0),
     FORMERR),
    ("option past the OPT", _header(ar=1) + QUESTION + b"\x00" + struct.pack("!HHIH", 41, 1232, 0, 4)
     + b"\x00\x08\x00\x09", FORMERR),
    ("ECS unknown family", _header(ar=1) + QUESTION + _opt(_ecs(3, 8, 0, b"\x01")), FORMERR),
    ("ECS prefix too long", _header(ar=1) + QUESTION + _opt(_ecs(1, 33, 0, b"\x01\x02\x03\x04\x05")), FORMERR),
    ("ECS scope set in a query", _header(ar=1) + QUESTION + _opt(_ecs(1, 24, 8, b"\x01\x02\x03")), FORMERR),
    ("ECS address too long", _header(ar=1) + QUESTION + _opt(_ecs(1, 8, 0, b"\x01\x02")), FORMERR),
    ("ECS bits beyond prefix", _header(ar=1) + QUESTION + _opt(_ecs(1, 20, 0, b"\x01\x02\x0f")), FORMERR),
    ("two ECS options", _header(ar=1) + QUESTION + _opt(_ecs(1, 8, 0, b"\x01") * 2), FORMERR),
    ("status opcode", _header(flags=0x1100) + QUESTION, NOTIMP),
    ("notify opcode", _header(flags=0x2100) + QUESTION, NOTIMP),
    ("update opcode", _header(flags=0x2800, an=0) + QUESTION, NOTIMP),
    ("TSIG-signed query", _header(ar=1) + QUESTION + b"\x03key\x00" + struct.pack("!HHIH", 250, 255, 0, 0),
     NOTAUTH),
]


@pytest.mark.parametrize(("case", "wire", "rcode"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed(case: str, wire: bytes, rcode: int | None) -> None:
    with pytest.raises(MessageError) as caught:
        parse_query(wire)
    assert caught.value.rcode == rcode


def test_ecs_family_zero_with_no_address_is_accepted() -> None:
    parsed = parse_query(_header(ar=1) + QUESTION + _opt(_ecs(0, 0, 0, b"")))
    assert parsed.edns is not None and parsed.edns.client_subnet is not None
    assert parsed.edns.client_subnet.ip is None


@functools.cache
def _responder() -> Responder:
    tables = tables_for([ha("shop")], {"shop": up(*ALL)})
    return Responder(ZoneHolder(tables), DnsCounters())


def _check_response(data: bytes, out: bytes | None) -> None:
    """A response is None (dropped) or a message dnspython can parse, echoing the ID."""
    if out is None:
        return
    qid, flags = struct.unpack_from("!HH", out)
    if (flags >> 11) & 0xF == dns.opcode.UPDATE:
        # dnspython reads an UPDATE's question as a zone section and insists it be SOA; our
        # NOTIMP answer just echoes whatever was asked, so check its header by hand.
        # (a malformed one, cut or flipped, is FORMERR, as RFC 2136 asks)
        assert qid == struct.unpack_from("!H", data)[0] and flags & 0x8000 and flags & 0xF in (NOTIMP, FORMERR)
        return
    response = dns.message.from_wire(out)
    assert response.id == struct.unpack_from("!H", data)[0]
    assert response.flags & 0x8000


@settings(max_examples=600, derandomize=True, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=80))
def test_fuzz_random_bytes_never_crash(data: bytes) -> None:
    responder = _responder()
    for tcp in (False, True):
        _check_response(data, responder.respond(data, "127.0.0.1", tcp=tcp)) if len(data) >= 2 else None


@settings(max_examples=800, derandomize=True, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_fuzz_mutated_queries_never_crash_and_accepted_ones_are_valid(data: st.DataObject) -> None:
    wire = _mutated(data, 1, 4, ("flip", "cut", "insert"))
    try:
        parse_query(wire)
        accepted = True
    except MessageError:
        accepted = False
    if accepted:
        # Whatever we accept has a header and question the reference parser reads the same way.
        # (Additional records other than OPT are skipped unread, as most servers do, so their
        # contents may be garbage dnspython would refuse.)
        reference = dns.message.from_wire(wire, question_only=True)
        ours = parse_query(wire)
        assert (reference.id, reference.question[0].rdtype) == (ours.id, ours.qtype)
    if len(wire) >= 2:
        _check_response(wire, _responder().respond(wire, "127.0.0.1", tcp=False))


def test_formerr_echoes_id_and_opcode_and_drops_nothing_else() -> None:
    out = _responder().respond(_header(qid=0xBEEF, ar=1) + QUESTION, "127.0.0.1", tcp=False)
    assert out is not None
    response = dns.message.from_wire(out)
    assert response.id == 0xBEEF
    assert response.rcode() == dns.rcode.FORMERR
    assert response.question[0].name.to_text() == "shop.g.example.com."


def test_notimp_for_update() -> None:
    update = dns.message.make_query(ZONE, "SOA")
    update.set_opcode(dns.opcode.UPDATE)
    out = _responder().respond(update.to_wire(), "127.0.0.1", tcp=False)
    assert out is not None
    response = dns.message.from_wire(out)
    assert response.rcode() == dns.rcode.NOTIMP
    assert response.opcode() == dns.opcode.UPDATE


def test_memo_serves_repeats_with_the_new_id_and_follows_table_swaps() -> None:
    holder = ZoneHolder(tables_for([ha("shop")], {"shop": up(*ALL)}))
    responder = Responder(holder, DnsCounters())
    query = dns.message.make_query(f"shop.{ZONE}", "A")
    for qid in (1, 2, 3):
        query.id = qid
        response = dns.message.from_wire(responder.respond(query.to_wire(), None, tcp=False) or b"")
        assert response.id == qid
        assert {r.to_text() for rrset in response.answer for r in rrset} == {"192.0.2.11"}
    memo = holder.tables.response_memo if holder.tables else None
    assert memo is not None and len(memo) == 1
    holder.replace(tables_for([ha("shop")], {"shop": {"ams1": up("ams1")["ams1"]}}))
    response = dns.message.from_wire(responder.respond(query.to_wire(), None, tcp=False) or b"")
    assert {r.to_text() for rrset in response.answer for r in rrset} == {"192.0.2.12"}


def test_no_zone_yet_is_servfail() -> None:
    responder = Responder(ZoneHolder(), DnsCounters())
    out = responder.respond(dns.message.make_query(f"shop.{ZONE}", "A").to_wire(), None, tcp=False)
    assert dns.message.from_wire(out or b"").rcode() == dns.rcode.SERVFAIL


def test_memo_can_be_turned_off() -> None:
    holder = ZoneHolder(tables_for([ha("shop")], {"shop": up(*ALL)}))
    responder = Responder(holder, DnsCounters(), ResponderLimits(memo_entries=0))
    responder.respond(dns.message.make_query(f"shop.{ZONE}", "A").to_wire(), None, tcp=False)
    assert holder.tables is not None and holder.tables.response_memo is None


_ANSWER_RECORD = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 0, 4) + b"\xc0\x00\x02\x01"
_TSIG_RECORD = b"\x03key\x00" + struct.pack("!HHIH", 250, 255, 0, 0)
ERRORS_TO_QUERIES_WITH_OPT = [
    ("FORMERR, no question", _header(qd=0, ar=1) + _opt(), FORMERR),
    ("FORMERR, answer records", _header(an=1, ar=1) + QUESTION + _ANSWER_RECORD + _opt(), FORMERR),
    ("FORMERR, trailing junk", _header(ar=1) + QUESTION + _opt() + b"\x00", FORMERR),
    ("NOTIMP, status opcode", _header(flags=0x1100, ar=1) + QUESTION + _opt(), NOTIMP),
    ("NOTIMP, notify opcode", _header(flags=0x2100, ar=1) + QUESTION + _opt(ttl=0x8000), NOTIMP),
    ("NOTAUTH, TSIG", _header(ar=2) + QUESTION + _opt() + _TSIG_RECORD, NOTAUTH),
]


@pytest.mark.parametrize(("case", "wire", "rcode"), ERRORS_TO_QUERIES_WITH_OPT,
                         ids=[c[0] for c in ERRORS_TO_QUERIES_WITH_OPT])
def test_error_responses_carry_an_opt_when_the_query_had_one(case: str, wire: bytes, rcode: int) -> None:
    """RFC 6891 §6.1.1: an OPT in the query means an OPT in the response, errors included."""
    out = _responder().respond(wire, "127.0.0.1", tcp=False)
    assert out is not None
    response = dns.message.from_wire(out)
    assert response.rcode() == rcode
    assert (response.edns, response.payload) == (0, 1232)
    query_do = struct.unpack_from("!I", wire, wire.index(b"\x00\x00\x29") + 5)[0] & 0x8000
    assert response.ednsflags & 0x8000 == query_do  # DO copied (RFC 3225 §3)


def test_an_error_response_echoes_the_client_subnet_with_scope_zero() -> None:
    wire = _header(flags=0x1100, ar=1) + QUESTION + _opt(_ecs(1, 24, 0, b"\xcb\x00\x71"))
    response = dns.message.from_wire(_responder().respond(wire, "127.0.0.1", tcp=False) or b"")
    assert response.rcode() == NOTIMP
    (ecs,) = response.options
    assert isinstance(ecs, dns.edns.ECSOption)
    assert (ecs.address, ecs.srclen, ecs.scopelen) == ("203.0.113.0", 24, 0)


@pytest.mark.parametrize("wire", [
    _header(ar=2) + QUESTION + _opt() + _opt(),
    _header(ar=1) + QUESTION + _opt(_ecs(3, 8, 0, b"\x01")),
    _header(ar=1) + QUESTION + b"\x01a\x00" + struct.pack("!HHIH", 41, 1232, 0, 0),
    _header(an=1, ar=1) + QUESTION + b"\x3f",
], ids=["two OPTs", "unreadable option", "OPT not at the root", "records that can not be walked"])
def test_no_opt_in_the_error_when_the_query_opt_could_not_be_read(wire: bytes) -> None:
    response = dns.message.from_wire(_responder().respond(wire, "127.0.0.1", tcp=False) or b"")
    assert response.rcode() == FORMERR
    assert response.edns == -1


@pytest.mark.parametrize("rdtype", ["AXFR", "IXFR"])
def test_zone_transfers_are_refused_with_the_opt(rdtype: str) -> None:
    query = dns.message.make_query(ZONE, rdtype, use_edns=0)
    if rdtype == "IXFR":  # carries the client's SOA in authority (RFC 1995 §3)
        query.authority.append(dns.rrset.from_text(f"{ZONE}.", 0, "IN", "SOA", f"ns1.{ZONE}. h.{ZONE}. 7 1 1 1 1"))
    for tcp in (False, True):
        response = dns.message.from_wire(_responder().respond(query.to_wire(), "127.0.0.1", tcp=tcp) or b"")
        assert response.rcode() == dns.rcode.REFUSED
        assert response.edns == 0


def test_a_refused_query_outside_the_zone_carries_the_opt() -> None:
    query = dns.message.make_query("example.org", "A", use_edns=0)
    response = dns.message.from_wire(_responder().respond(query.to_wire(), "127.0.0.1", tcp=False) or b"")
    assert (response.rcode(), response.edns) == (dns.rcode.REFUSED, 0)


def _parsed(wire: bytes, known: frozenset[bytes] = frozenset()) -> tuple[object, ...]:
    """What parse_query makes of ``wire``: the query's fields, or the error's."""
    try:
        q = parse_query(wire, known)
    except MessageError as error:
        return ("error", error.reason, error.rcode, error.query_id, error.flags, error.question, error.edns)
    return ("query", q.id, q.flags, q.qname, q.qname_lower, q.qtype, q.qclass, q.edns, q.question)


_KNOWN = frozenset(name_from_text(n) for n in (f"shop.{ZONE}", ZONE, f"a-b.c.{ZONE}", "example.org"))


@settings(max_examples=800, derandomize=True, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_the_short_ways_parse_exactly_as_the_long_one(data: st.DataObject) -> None:
    """Known names (no label walk) and the OPT memo (no OPT parse) give what a cold, plain parse gives."""
    wire = _mutated(data, 0, 3, ("flip", "cut", "insert", "case"))
    wire_module._OPT_MEMO.clear()
    cold = _parsed(wire)
    assert _parsed(wire) == cold  # the OPT now memoised
    assert _parsed(wire, _KNOWN) == cold
    if cold[0] == "query":  # and the name is the one the reference parser reads
        reference = dns.message.from_wire(wire, question_only=True)
        assert (reference.question[0].name.to_wire() or b"").lower() == cold[4]


def test_a_known_name_keeps_the_case_it_was_sent_in() -> None:
    wire = dns.message.make_query("ShOp.G.example.COM", "A").to_wire()
    query = parse_query(wire, _KNOWN)
    assert query.qname == b"\x04ShOp\x01G\x07example\x03COM\x00"
    assert query.qname_lower == name_from_text(f"shop.{ZONE}")


def test_a_zero_octet_inside_a_label_does_not_end_the_name() -> None:
    name = b"\x03A\x00B" + name_from_text(f"shop.{ZONE}")  # the first zero octet is inside the label 'A\0B'
    query = parse_query(_header() + name + b"\x00\x01\x00\x01", _KNOWN)
    assert (query.qname, query.qname_lower) == (name, name.lower())


def test_the_opt_memo_is_bounded_and_keeps_only_short_records() -> None:
    wire_module._OPT_MEMO.clear()
    for i in range(wire_module.OPT_MEMO_ENTRIES + 10):
        subnet = str(ipaddress.IPv4Address(0x0A000000 + (i << 8)))
        query = dns.message.make_query(f"shop.{ZONE}", "A", use_edns=0, options=[dns.edns.ECSOption(subnet, 24)])
        edns = parse_query(query.to_wire()).edns
        assert edns is not None and edns.client_subnet is not None
        assert edns.client_subnet.ip == ipaddress.IPv4Address(subnet)
        assert len(wire_module._OPT_MEMO) <= wire_module.OPT_MEMO_ENTRIES
    wire_module._OPT_MEMO.clear()
    padding = dns.edns.GenericOption(dns.edns.OptionType.PADDING, bytes(wire_module.OPT_MEMO_BYTES))
    parse_query(dns.message.make_query(f"shop.{ZONE}", "A", use_edns=0, options=[padding]).to_wire())
    assert not wire_module._OPT_MEMO
