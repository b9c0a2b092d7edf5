"""The case-blind response memo: hits for 0x20 queries, no sharing across what changes an answer,
entry-by-entry eviction that a flood of one-off names cannot use to push out a hot entry, and
responses byte-identical to rendering every query afresh."""

from __future__ import annotations

import dataclasses
import mmap
import random
import struct

import dns.flags
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from region_agent.globaldns.answer import Responder, ResponderLimits, answer, render
from region_agent.globaldns.memo import Entry, ResponseMemo, memo_key, memoisable
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.tables import Reply, ZoneHolder, ZoneTables
from region_agent.globaldns.wire import BADVERS, TC, Query, header, opt_record, parse_query, response_flags
from tests.fakes.dns_client import query_wire
from tests.globaldns.zones import ALL, ZONE, PrefixLocator, ha, proximity, tables_for, up

LOCATOR = PrefixLocator({"198.51.100.0/24": (["ams1", "sfo1"], 24), "203.0.113.0/24": (["nrt1"], 24)})


def _tables() -> ZoneTables:
    return tables_for([ha("shop"), proximity("near")], {"shop": up(*ALL), "near": up(*ALL)}, locator=LOCATOR)


def _pair(capacity: int = 20_000) -> tuple[Responder, Responder, ZoneHolder]:
    """A responder with the memo and one without, on the same tables."""
    tables = _tables()
    holder = ZoneHolder(tables)
    memo = Responder(holder, DnsCounters(), ResponderLimits(memo_entries=capacity))
    # the same compiled zone (same serial), but not the same object: it carries the memo
    plain = Responder(ZoneHolder(dataclasses.replace(tables)), DnsCounters(), ResponderLimits(memo_entries=0))
    return memo, plain, holder


def test_a_responder_without_memo_never_reads_one() -> None:
    memo, _, holder = _pair()
    plain = Responder(holder, DnsCounters(), ResponderLimits(memo_entries=0))  # the same tables
    wire = _query(f"shop.{ZONE}")
    for _ in range(3):
        memo.respond(wire, None, tcp=False)
        plain.respond(wire, None, tcp=False)
    assert memo.counters.memo_hits == 2 and plain.counters.memo_hits == 0


def _query(name: str, qtype: str = "A", *, qid: int = 7, edns: int = 0, payload: int = 1232, do: bool = False,
           ecs: tuple[str, int] | None = None, flags: int = dns.flags.RD) -> bytes:
    return query_wire(name, qtype, qid=qid, use_edns=edns, payload=payload, want_dnssec=do, ecs=ecs, flags=flags)


def _random_case(name: str, rng: random.Random) -> str:
    return "".join(c.upper() if rng.random() < 0.5 else c for c in name)


def test_a_0x20_query_hits_the_memo_and_echoes_its_own_case() -> None:
    responder, plain, _ = _pair()
    lower = _query(f"shop.{ZONE}")
    responder.respond(lower, None, tcp=False)
    responder.respond(lower, None, tcp=False)  # second query: promoted out of probation
    hits = responder.counters.memo_hits
    rng = random.Random(1)
    for qid in range(20):
        wire = _query(_random_case(f"shop.{ZONE}", rng), qid=qid)
        out = responder.respond(wire, "192.0.2.1", tcp=False)
        assert out == plain.respond(wire, "192.0.2.1", tcp=False) == _udp_answer(responder, wire, "192.0.2.1")
        question = parse_query(wire).question
        assert out is not None and out[12:12 + len(question)] == question  # the query's own case
    assert responder.counters.memo_hits == hits + 2 * 20  # respond and the UDP listener's hitter alike


VARIANTS: dict[str, dict[str, object]] = {
    "plain": {"edns": -1},
    "no RD": {"edns": -1, "flags": 0},
    "RD and CD": {"edns": -1, "flags": dns.flags.RD | dns.flags.CD},
    "EDNS 1232": {},
    "EDNS 4096": {"payload": 4096},
    "EDNS 512": {"payload": 512},
    "DO": {"do": True},
    "ECS 192.0.2.0/24": {"ecs": ("192.0.2.0", 24)},
    "ECS 192.0.3.0/24": {"ecs": ("192.0.3.0", 24)},
    "ECS 192.0.2.0/20": {"ecs": ("192.0.0.0", 20)},
    "ECS ::/0": {"ecs": ("::", 0)},
    "type AAAA": {"qtype": "AAAA"},
    "type NS": {"qtype": "NS"},
    "type TXT (NODATA)": {"qtype": "TXT"},
}


def test_different_edns_ecs_flags_type_and_transport_never_share_an_entry() -> None:
    responder, plain, holder = _pair()
    wires = []
    for variant in VARIANTS.values():
        args: dict[str, object] = dict(variant)
        qtype = str(args.pop("qtype", "A"))
        wires.append(_query(f"shop.{ZONE}", qtype, **args))  # type: ignore[arg-type]
    for _ in range(3):  # miss, hit (promoted out of probation), hit
        for wire in wires:
            for tcp in (False, True):
                assert responder.respond(wire, "192.0.2.1", tcp=tcp) == plain.respond(wire, "192.0.2.1", tcp=tcp)
    assert holder.tables is not None
    udp_memo, tcp_memo = holder.tables.response_memo, holder.tables.tcp_response_memo
    assert udp_memo is not None and tcp_memo is not None
    assert len(udp_memo.main) == len(tcp_memo.main) == len(VARIANTS)
    assert responder.counters.memo_hits == 2 * 2 * len(VARIANTS)  # rounds two and three, both transports


def test_nxdomain_refused_badvers_and_client_dependent_answers_are_not_memoised() -> None:
    responder, _, holder = _pair()
    for wire in (_query(f"nope.{ZONE}"), _query("example.org"), _query(f"shop.{ZONE}", edns=1),
                 _query(f"near.{ZONE}", ecs=("198.51.100.0", 24))):
        for _ in range(3):
            responder.respond(wire, "192.0.2.1", tcp=False)
    assert holder.tables is not None and holder.tables.response_memo is None
    assert holder.tables.tcp_response_memo is None and responder.counters.memo_hits == 0


def test_a_flood_of_one_off_names_does_not_evict_a_hot_entry() -> None:
    responder, _, holder = _pair(capacity=200)
    hot = _query(f"shop.{ZONE}")
    responder.respond(hot, None, tcp=False)
    rng = random.Random(7)
    for i in range(20_000):
        # random subdomains (NXDOMAIN), random types (NODATA) and random ECS (distinct NOERROR entries)
        kind = i % 3
        if kind == 0:
            wire = _query(f"{rng.getrandbits(40):x}.{ZONE}")
        elif kind == 1:
            wire = _query(f"shop.{ZONE}", f"TYPE{rng.randrange(100, 65000)}")
        else:
            wire = _query(f"shop.{ZONE}", ecs=(f"10.{rng.randrange(256)}.{rng.randrange(256)}.0", 24))
        responder.respond(wire, "192.0.2.1", tcp=False)
        if i % 100 == 0:
            hits = responder.counters.memo_hits
            responder.respond(hot, None, tcp=False)
            assert responder.counters.memo_hits == hits + 1, f"hot entry missed after {i} flood queries"
    memo = holder.tables.response_memo if holder.tables else None
    assert memo is not None and len(memo) <= 200


def test_main_pool_evicts_one_entry_at_a_time_giving_used_entries_a_second_chance() -> None:
    memo = ResponseMemo(8)  # probation 2, main 6
    entry = Entry(bytes(20), 4, 1, 0, b"")
    keys = [bytes([i]) for i in range(10)]
    for key in keys[:6]:
        memo.put(key, entry if key != keys[0] else Entry(bytes(20), 4, 1, 0, b"hot"))
        assert memo.get(key) is not None  # promoted into main
    memo.main[keys[1]].hot = False  # each promotion above left the previous entries' bits alone
    hot = memo.get(keys[0])
    assert hot is not None and hot.hot
    for entry_ in memo.main.values():
        if entry_ is not hot:
            entry_.hot = False
    memo.put(keys[6], Entry(bytes(20), 4, 1, 0, b""))
    memo.get(keys[6])  # main full: the oldest (keys[0]) is hot, so it survives and keys[1] goes
    assert keys[0] in memo.main and keys[1] not in memo.main and keys[6] in memo.main
    assert len(memo.main) == 6 and not memo.main[keys[0]].hot


def test_probation_is_fifo_and_bounded() -> None:
    memo = ResponseMemo(8)
    for i in range(5):
        memo.put(bytes([i]), Entry(bytes(20), 4, 1, 0, b""))
    assert list(memo.probation) == [bytes([3]), bytes([4])] and not memo.main


def test_memo_key_folds_only_the_name() -> None:
    upper, lower = _query(f"SHOP.{ZONE.upper()}"), _query(f"shop.{ZONE}")
    assert memo_key(upper) == memo_key(lower)
    assert memo_key(_query(f"shop.{ZONE}", flags=dns.flags.AD)) != memo_key(lower)  # header bits are kept
    assert memo_key(_query(f"shop.{ZONE}", "TYPE65")) != memo_key(_query(f"shop.{ZONE}", "TYPE97"))  # 'A' vs 'a'
    ecs_a, ecs_a_lower = _query(f"shop.{ZONE}", ecs=("65.0.0.0", 8)), _query(f"shop.{ZONE}", ecs=("97.0.0.0", 8))
    assert memo_key(ecs_a) != memo_key(ecs_a_lower)
    # a label holding a zero octet: the fold stops there, the rest is compared as is
    odd = b"\x00\x01\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x02A\x00\x01B\x00\x00\x01\x00\x01"
    assert memo_key(odd) != memo_key(odd.replace(b"\x01B", b"\x01b"))


def test_only_queries_with_at_most_one_additional_record_are_memoised() -> None:
    wire = _query(f"shop.{ZONE}")
    assert memoisable(wire) and memoisable(_query(f"shop.{ZONE}", edns=-1))
    assert not memoisable(wire[:10] + struct.pack("!H", 0x41) + wire[12:])


def test_malformed_neighbours_of_a_memoised_query_are_not_served_from_the_memo() -> None:
    responder, plain, _ = _pair()
    wire = _query(f"shop.{ZONE}")
    for _ in range(3):
        responder.respond(wire, None, tcp=False)
    qdcount_2 = wire[:4] + struct.pack("!H", 2) + wire[6:]
    for bad in (wire + b"\x00", qdcount_2, wire[:-1]):
        assert responder.respond(bad, None, tcp=False) == plain.respond(bad, None, tcp=False)


NAMES = [f"shop.{ZONE}", f"near.{ZONE}", ZONE, f"ns-sfo1.{ZONE}", f"nope.{ZONE}", f"a.b.shop.{ZONE}", "example.org"]
QUERY = st.fixed_dictionaries({
    "name": st.sampled_from(NAMES),
    "case": st.integers(0, 2**32 - 1),
    "qtype": st.sampled_from(["A", "AAAA", "NS", "SOA", "TXT", "ANY", "MX"]),
    "edns": st.sampled_from([-1, 0, 1]),
    "payload": st.sampled_from([512, 1232, 4096]),
    "do": st.booleans(),
    "ecs": st.sampled_from([None, ("198.51.100.0", 24), ("203.0.113.0", 24), ("192.0.2.0", 24), ("::", 0)]),
    "flags": st.sampled_from([0, dns.flags.RD, dns.flags.RD | dns.flags.CD, dns.flags.AD]),
    "qid": st.integers(0, 65535),
    "tcp": st.booleans(),
    "source": st.sampled_from(["198.51.100.9", "203.0.113.5", "192.0.2.1", "2001:db8::1"]),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(QUERY, min_size=1, max_size=12), st.integers(1, 4))
def test_memo_on_and_off_answer_byte_identically(queries: list[dict[str, object]], repeats: int) -> None:
    responder, plain, _ = _pair(capacity=8)  # small: eviction and promotion happen too
    for _ in range(repeats):
        for q in queries:
            rng = random.Random(q["case"])  # type: ignore[arg-type]
            if q["edns"] == -1 and q["ecs"] is not None:
                continue  # ECS needs EDNS
            wire = _query(_random_case(str(q["name"]), rng), str(q["qtype"]), qid=int(q["qid"]),  # type: ignore[call-overload]
                          edns=int(q["edns"]), payload=int(q["payload"]), do=bool(q["do"]),  # type: ignore[call-overload]
                          ecs=q["ecs"], flags=int(q["flags"]))  # type: ignore[arg-type,call-overload]
            tcp, source = bool(q["tcp"]), str(q["source"])
            assert responder.respond(wire, source, tcp=tcp) == plain.respond(wire, source, tcp=tcp)


def _udp_answer(responder: Responder, wire: bytes, source: str) -> bytes | None:
    """What the UDP listener sends: the batch's hitter first (in place, in a slot of a mapped
    buffer as the listener's), the miss path when it declines."""
    hit = responder.udp_hitter()
    if hit is not None:
        buffer = mmap.mmap(-1, 2 * 65536)
        at = 65536  # not the first slot: offsets count from the slot's start
        buffer[at:at + len(wire)] = wire
        size = hit(buffer, at, len(wire))
        if size:
            return buffer[at:at + size]
        assert buffer[at:at + len(wire)] == wire  # declining leaves the query as it was
    return responder.udp_miss(wire, source)


# ECS addresses whose octets are the ASCII letters 'AB' and 'ab': a key that folded more than
# the name would give the second the first's entry (and its echo)
CASE_TWINS = [("65.66.0.0", 16), ("97.98.0.0", 16)]


def test_ecs_octets_that_spell_letters_of_either_case_never_share_an_entry() -> None:
    responder, plain, _ = _pair()
    twins = [_query(f"shop.{ZONE}", ecs=ecs) for ecs in CASE_TWINS]
    for _ in range(3):
        for wire in twins + twins[::-1]:
            assert _udp_answer(responder, wire, "192.0.2.1") == plain.respond(wire, "192.0.2.1", tcp=False)
    assert responder.counters.memo_hits == 3 * 4 - 2  # each twin's first query misses, every later one hits


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(QUERY, min_size=1, max_size=12), st.integers(1, 4), st.sampled_from([None, *CASE_TWINS]))
def test_the_udp_hitter_answers_byte_identically_to_rendering(queries: list[dict[str, object]], repeats: int,
                                                               twin: tuple[str, int] | None) -> None:
    responder, plain, _ = _pair(capacity=8)
    for _ in range(repeats):
        for q in queries:
            if q["edns"] == -1 and q["ecs"] is not None:
                continue
            case = int(q["case"])  # type: ignore[call-overload]
            name = str(q["name"]) if case % 3 == 0 else _random_case(str(q["name"]), random.Random(case))
            wire = _query(name, str(q["qtype"]), qid=int(q["qid"]),  # type: ignore[call-overload]
                          edns=int(q["edns"]), payload=int(q["payload"]), do=bool(q["do"]),  # type: ignore[call-overload]
                          ecs=twin if twin is not None and q["edns"] != -1 else q["ecs"],  # type: ignore[arg-type]
                          flags=int(q["flags"]))  # type: ignore[call-overload]
            source = str(q["source"])
            assert _udp_answer(responder, wire, source) == plain.respond(wire, source, tcp=False)


def _reference_render(query: Query, reply: Reply, *, max_size: int, our_payload: int) -> bytes:
    """``render`` as it was written before it was inlined: wire's own helpers, one call each."""
    opt = b""
    edns = query.edns
    if edns is not None:
        options = b"" if edns.client_subnet is None else edns.client_subnet.option(reply.scope)
        opt = opt_record(our_payload, extended_rcode=reply.rcode, do=edns.do, options=options)
    answer_data, authority_data, additional_data = reply.answer.data, reply.authority.data, reply.additional.data
    an, ns, ar = reply.answer.count, reply.authority.count, reply.additional.count
    flags = response_flags(query.flags, rcode=reply.rcode, aa=reply.aa)
    size = 12 + len(query.question) + len(answer_data) + len(authority_data) + len(additional_data) + len(opt)
    if size > max_size:
        additional_data, ar = b"", 0
        if size - len(reply.additional.data) > max_size:
            answer_data, authority_data, an, ns = b"", b"", 0, 0
            flags |= TC
    return (header(query.id, flags, 1, an, ns, ar + (1 if opt else 0)) + query.question + answer_data
            + authority_data + additional_data + opt)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(QUERY, st.sampled_from([0, 60, 120, 300, 512, 1232, 65535]))
def test_render_matches_the_reference(q: dict[str, object], max_size: int) -> None:
    if q["edns"] == -1 and q["ecs"] is not None:
        return
    rng = random.Random(q["case"])  # type: ignore[arg-type]
    wire = _query(_random_case(str(q["name"]), rng), str(q["qtype"]), qid=int(q["qid"]),  # type: ignore[call-overload]
                  edns=int(q["edns"]), payload=int(q["payload"]), do=bool(q["do"]),  # type: ignore[call-overload]
                  ecs=q["ecs"], flags=int(q["flags"]) | dns.flags.AA | dns.flags.TC)  # type: ignore[arg-type,call-overload]
    query = parse_query(wire)
    reply = answer(_TABLES, query, str(q["source"]))
    for rcode_reply in (reply, dataclasses.replace(reply, rcode=BADVERS), dataclasses.replace(reply, aa=not reply.aa)):
        assert render(query, rcode_reply, max_size=max_size, our_payload=1232) == _reference_render(
            query, rcode_reply, max_size=max_size, our_payload=1232)


_TABLES = _tables()
