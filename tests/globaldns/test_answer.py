"""Table-driven tests of the pure answer path (compile → answer → render), no sockets."""

from __future__ import annotations

import time

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest

from region_agent.globaldns.answer import answer
from region_agent.globaldns.compiler import ZoneConfig, _empty_nonterminals, compile_zone
from region_agent.globaldns.wire import name_from_text, parse_query
from region_agent.state.hlc import HybridClock
from region_agent.state.model import AllDownPolicy, CopyHealth, Mode, Project, Region
from region_agent.state.store import Entry, Store, Version
from tests.fakes.dns_client import rdata_texts
from tests.globaldns.zones import (
    ALL,
    ZONE,
    PrefixLocator,
    ask,
    down,
    ha,
    proximity,
    store_with,
    tables_for,
    up,
)

S, A_, N = "192.0.2.11", "192.0.2.12", "192.0.2.13"

HA_CASES = [
    # (name, health of shop's copies, policy, expected rcode, expected addresses)
    ("all up: the primary", {**up("sfo1", "ams1", "nrt1")}, AllDownPolicy.ALL, "NOERROR", {S}),
    ("primary down: healthy backups", {**down("sfo1"), **up("ams1", "nrt1")}, AllDownPolicy.ALL, "NOERROR",
     {A_, N}),
    ("primary and one backup down", {**down("sfo1", "ams1"), **up("nrt1")}, AllDownPolicy.ALL, "NOERROR", {N}),
    ("only a backup down", {**up("sfo1", "nrt1"), **down("ams1")}, AllDownPolicy.ALL, "NOERROR", {S}),
    ("all down, policy all", down(*ALL), AllDownPolicy.ALL, "NOERROR", {S, A_, N}),
    ("all down, policy primary", down(*ALL), AllDownPolicy.PRIMARY, "NOERROR", {S}),
    ("all down, policy empty", down(*ALL), AllDownPolicy.EMPTY, "NOERROR", set()),
    ("all down, policy servfail", down(*ALL), AllDownPolicy.SERVFAIL, "SERVFAIL", set()),
    ("unknown health counts as down", {**up("nrt1")}, AllDownPolicy.ALL, "NOERROR", {N}),
    ("primary's only address failed its own check", {**up("sfo1", failed=(S,)), **up("ams1")},
     AllDownPolicy.ALL, "NOERROR", {A_}),
]


@pytest.mark.parametrize(("case", "health", "policy", "rcode", "expected"), HA_CASES, ids=[c[0] for c in HA_CASES])
def test_ha(case: str, health: dict[str, CopyHealth], policy: AllDownPolicy, rcode: str, expected: set[str]) -> None:
    tables = tables_for([ha("shop", policy)], {"shop": health})
    response = ask(tables, f"shop.{ZONE}")
    assert dns.rcode.to_text(response.rcode()) == rcode
    assert rdata_texts(response) == expected
    if rcode == "NOERROR":
        assert response.flags & dns.flags.AA
        for rrset in response.answer:
            assert rrset.ttl == 30
    else:
        assert not response.flags & dns.flags.AA
    if rcode == "NOERROR" and not expected:  # NODATA: the SOA says how long to cache it
        assert [rrset.rdtype for rrset in response.authority] == [dns.rdatatype.SOA]


def test_ha_is_per_address_family() -> None:
    """Like two ifurlup records (A and AAAA): sfo1 alone has IPv6, so AAAA follows sfo1's health only."""
    healthy = tables_for([ha("shop")], {"shop": up(*ALL)})
    assert rdata_texts(ask(healthy, f"shop.{ZONE}", "AAAA")) == {"2001:db8::11"}
    sfo1_down = tables_for([ha("shop")], {"shop": {**down("sfo1"), **up("ams1", "nrt1")}})
    assert rdata_texts(ask(sfo1_down, f"shop.{ZONE}", "AAAA")) == {"2001:db8::11"}  # all down for v6: every address
    assert rdata_texts(ask(sfo1_down, f"shop.{ZONE}", "A")) == {A_, N}


@pytest.mark.parametrize(
    ("startup", "rcode", "expected"),
    [
        (AllDownPolicy.ALL, "NOERROR", {S, A_, N}),
        (AllDownPolicy.PRIMARY, "NOERROR", {S}),
        (AllDownPolicy.SERVFAIL, "SERVFAIL", set()),
        (AllDownPolicy.EMPTY, "NOERROR", set()),
    ],
)
def test_before_the_first_health_round(startup: AllDownPolicy, rcode: str, expected: set[str]) -> None:
    tables = tables_for([ha("shop")], {"shop": up(*ALL)}, health_known=False, startup_answer=startup)
    response = ask(tables, f"shop.{ZONE}")
    assert dns.rcode.to_text(response.rcode()) == rcode
    assert rdata_texts(response) == expected


LOCATOR_TABLE = {
    "203.0.113.0/24": (["ams1", "sfo1", "nrt1"], 20),  # "Europe"
    "198.51.100.0/24": (["sfo1", "nrt1", "ams1"], 18),  # "America"
    "2001:db8:aa::/48": (["nrt1", "sfo1", "ams1"], 40),  # "Asia", IPv6
}


@pytest.mark.parametrize(
    ("case", "health", "kwargs", "expected", "scope"),
    [
        ("ECS picks the client's closest", up(*ALL), {"ecs": ("203.0.113.0", 24)}, {A_}, 20),
        ("no ECS: the source address", up(*ALL), {"source": "198.51.100.9"}, {S}, None),
        ("IPv6 ECS", up(*ALL), {"ecs": ("2001:db8:aa::", 56)}, {N}, 40),
        ("closest is down: the next closest", {**down("ams1"), **up("sfo1", "nrt1")},
         {"ecs": ("203.0.113.0", 24)}, {S}, 20),
        ("unlocated client: every healthy address", {**down("ams1"), **up("sfo1", "nrt1")},
         {"ecs": ("100.64.0.0", 24)}, {S, N}, 16),
        ("ECS source prefix 0: no client address used", up(*ALL), {"ecs": ("0.0.0.0", 0)}, {S, A_, N}, 0),
    ],
)
def test_proximity(case: str, health: dict[str, CopyHealth], kwargs: dict[str, object], expected: set[str],
                   scope: int | None) -> None:
    locator = PrefixLocator(LOCATOR_TABLE)
    tables = tables_for([proximity("blog")], {"blog": health}, locator=locator)
    response = ask(tables, f"blog.{ZONE}", **kwargs)  # type: ignore[arg-type]
    assert rdata_texts(response) == expected
    ecs = [o for o in response.options if o.otype == 8]
    if "ecs" in kwargs:
        assert len(ecs) == 1
        assert ecs[0].scopelen == scope
    else:
        assert ecs == []  # RFC 7871: never add ECS to a response whose query had none


def test_proximity_without_a_database_answers_every_healthy_region() -> None:
    tables = tables_for([proximity("blog")], {"blog": {**down("nrt1"), **up("sfo1", "ams1")}})
    response = ask(tables, f"blog.{ZONE}", ecs=("203.0.113.0", 24))
    assert rdata_texts(response) == {S, A_}
    assert [o.scopelen for o in response.options if o.otype == 8] == [0]


@pytest.mark.parametrize(("policy", "rcode", "expected"), [
    (AllDownPolicy.ALL, "NOERROR", {S, A_, N}),
    (AllDownPolicy.SERVFAIL, "SERVFAIL", set()),
    (AllDownPolicy.EMPTY, "NOERROR", set()),
])
def test_proximity_all_down(policy: AllDownPolicy, rcode: str, expected: set[str]) -> None:
    tables = tables_for([proximity("blog", policy)], {"blog": down(*ALL)}, locator=PrefixLocator(LOCATOR_TABLE))
    response = ask(tables, f"blog.{ZONE}", ecs=("203.0.113.0", 24))
    assert dns.rcode.to_text(response.rcode()) == rcode
    assert rdata_texts(response) == expected


def _zone() -> object:
    return tables_for([ha("shop"), proximity("blog")], {"shop": up(*ALL), "blog": up(*ALL)})


def test_nxdomain_carries_the_soa_with_the_negative_ttl() -> None:
    for name in (f"nope.{ZONE}", f"deep.below.shop.{ZONE}", f"x.ns-sfo1.{ZONE}"):
        response = ask(_zone(), name)  # type: ignore[arg-type]
        assert response.rcode() == dns.rcode.NXDOMAIN
        assert response.flags & dns.flags.AA
        assert response.answer == []
        (soa,) = response.authority
        assert soa.rdtype == dns.rdatatype.SOA
        assert soa.name.to_text() == f"{ZONE}."
        assert soa.ttl == 60  # min(SOA TTL 3600, MINIMUM 60), RFC 2308 §5


@pytest.mark.parametrize(("name", "qtype"), [
    (f"shop.{ZONE}", "MX"), (f"shop.{ZONE}", "TXT"), (f"shop.{ZONE}", "NS"), (ZONE, "A"), (f"ns-ams1.{ZONE}", "MX"),
    (f"ns-sfo1.{ZONE}", "AAAA"),
])
def test_nodata(name: str, qtype: str) -> None:
    response = ask(_zone(), name, qtype)  # type: ignore[arg-type]
    assert response.rcode() == dns.rcode.NOERROR
    assert response.flags & dns.flags.AA
    assert response.answer == []
    assert [r.rdtype for r in response.authority] == [dns.rdatatype.SOA]


def test_empty_non_terminal_is_nodata_not_nxdomain() -> None:
    """RFC 8020: a name with descendants but no data of its own exists (NODATA, not NXDOMAIN)."""
    apex = name_from_text(ZONE)
    deep = name_from_text(f"_acme-challenge.a.b.{ZONE}")
    assert _empty_nonterminals([apex, deep], apex) == {name_from_text(f"a.b.{ZONE}"), name_from_text(f"b.{ZONE}")}
    tables = tables_for([ha("shop")], {"shop": up(*ALL)})
    tables.empty_nonterminals = frozenset({name_from_text(f"b.{ZONE}")})
    assert ask(tables, f"b.{ZONE}").rcode() == dns.rcode.NOERROR
    assert ask(tables, f"B.{ZONE}").authority[0].rdtype == dns.rdatatype.SOA
    assert ask(tables, f"c.{ZONE}").rcode() == dns.rcode.NXDOMAIN


@pytest.mark.parametrize("name", ["example.org", "g.example.com.evil.net", "xg.example.com", "example.com", "."])
def test_outside_the_zone_is_refused(name: str) -> None:
    response = ask(_zone(), name)  # type: ignore[arg-type]
    assert response.rcode() == dns.rcode.REFUSED
    assert not response.flags & dns.flags.AA
    assert response.answer == [] and response.authority == []


def test_query_case_is_preserved_in_question_and_answer() -> None:
    name = "ShOp.G.eXaMpLe.CoM."
    response = ask(_zone(), name)  # type: ignore[arg-type]
    assert response.question[0].name.to_text() == name
    assert response.answer[0].name.to_text() == name  # a pointer to the question: byte-for-byte case
    nx = ask(_zone(), "NoPe.G.Example.COM.")  # type: ignore[arg-type]
    assert nx.authority[0].name.to_text() == "G.Example.COM."


def test_any_gets_the_rfc8482_answer() -> None:
    response = ask(_zone(), f"shop.{ZONE}", "ANY")  # type: ignore[arg-type]
    (hinfo,) = response.answer
    assert hinfo.rdtype == dns.rdatatype.HINFO
    assert hinfo[0].cpu == b"RFC8482" and hinfo[0].os == b""


def test_apex_soa_ns_and_glue() -> None:
    zone = _zone()
    soa = ask(zone, ZONE, "SOA")  # type: ignore[arg-type]
    assert soa.answer[0][0].mname.to_text() == f"ns-ams1.{ZONE}."
    assert soa.answer[0][0].minimum == 60
    ns = ask(zone, ZONE, "NS")  # type: ignore[arg-type]
    assert {r.to_text() for r in ns.answer[0]} == {f"ns-ams1.{ZONE}.", f"ns-sfo1.{ZONE}."}
    glue = {(rrset.name.to_text(), r.to_text()) for rrset in ns.additional for r in rrset}
    assert glue == {(f"ns-sfo1.{ZONE}.", "192.0.2.53"), (f"ns-ams1.{ZONE}.", "192.0.2.54"),
                    (f"ns-ams1.{ZONE}.", "2001:db8::54")}
    assert rdata_texts(ask(zone, f"ns-ams1.{ZONE}", "AAAA")) == {"2001:db8::54"}  # type: ignore[arg-type]


def test_serial_follows_the_state_not_the_clock() -> None:
    store = store_with([ha("shop")], {})
    first = compile_zone(store.snapshot(), ZoneConfig(ZONE)).serial
    assert compile_zone(store.snapshot(), ZoneConfig(ZONE)).serial == first
    # A peer that merged the same entries answers the same serial. A standalone writer's
    # entries are never merged from a peer, so the peer gets them as their owners write them.
    owned = [Entry(e.key, e.value, Version(e.version.hlc, "control/api"))
             for e in store.entries()]  # regions and projects only (control's): no copy health here
    peer = Store(writer="control/peer", clock=HybridClock(lambda: int(time.time() * 1000)))
    assert len(peer.merge(owned).applied) == len(owned)
    assert compile_zone(peer.snapshot(), ZoneConfig(ZONE)).serial == first  # same entries, same serial


def test_other_classes_and_zone_transfers_are_refused() -> None:
    assert ask(_zone(), f"shop.{ZONE}", rdclass="CH").rcode() == dns.rcode.REFUSED  # type: ignore[arg-type]
    assert ask(_zone(), ZONE, "AXFR", tcp=True).rcode() == dns.rcode.REFUSED  # type: ignore[arg-type]
    assert ask(_zone(), f"nope.{ZONE}", "IXFR", tcp=True).rcode() == dns.rcode.REFUSED  # type: ignore[arg-type]


def test_edns_is_echoed_only_when_asked() -> None:
    with_edns = ask(_zone(), f"shop.{ZONE}")  # type: ignore[arg-type]
    assert with_edns.edns == 0 and with_edns.payload == 1232
    without = ask(_zone(), f"shop.{ZONE}", use_edns=False)  # type: ignore[arg-type]
    assert without.edns == -1


def test_do_bit_is_copied() -> None:
    query = dns.message.make_query(f"shop.{ZONE}", "A", want_dnssec=True)
    parsed = parse_query(query.to_wire())
    assert parsed.edns is not None and parsed.edns.do


def test_edns_version_1_gets_badvers() -> None:
    response = ask(_zone(), f"shop.{ZONE}", use_edns=1)  # type: ignore[arg-type]
    assert response.rcode() == dns.rcode.BADVERS
    assert response.edns == 0
    assert response.answer == []


def _big_zone() -> object:
    many = Region("sfo1", ipv4=tuple(f"10.0.{i // 250}.{i % 250 + 1}" for i in range(100)), ns_ipv4=("192.0.2.53",))
    store = store_with([], {})
    store.put(("region", "sfo1"), many)
    store.put(("project", "big"), Project("big", ("sfo1",), mode=Mode.HA))
    store.put(("copy", "big", "sfo1"), CopyHealth(True))
    return compile_zone(store.snapshot(), ZoneConfig(ZONE))


@pytest.mark.parametrize(("kwargs", "truncated"), [
    ({"use_edns": False}, True),  # 512 bytes without EDNS
    ({"payload": 4096}, True),  # capped at our 1232
    ({"tcp": True}, False),
])
def test_truncation(kwargs: dict[str, object], truncated: bool) -> None:
    response = ask(_big_zone(), f"big.{ZONE}", **kwargs)  # type: ignore[arg-type]
    assert bool(response.flags & dns.flags.TC) is truncated
    assert len(rdata_texts(response)) == (0 if truncated else 100)


def test_glue_is_dropped_before_truncating() -> None:
    """RFC 2181 §9: TC is for the answer; additional records are left out silently."""
    store = store_with([], {})
    for i in range(10):
        name = f"aa{chr(97 + i % 26)}{i + 1}"
        store.put(("region", name), Region(name, ns_ipv4=(f"192.0.2.{i + 1}",), ns_ipv6=(f"2001:db8::{i + 1}",)))
    tables = compile_zone(store.snapshot(), ZoneConfig(ZONE))
    small = ask(tables, ZONE, "NS", use_edns=False)
    assert not small.flags & dns.flags.TC
    assert len(small.answer[0]) == 12
    assert small.additional == []
    full = ask(tables, ZONE, "NS", tcp=True)
    assert sum(len(rrset) for rrset in full.additional) == 23


def test_answer_is_a_lookup_that_shares_reply_objects() -> None:
    tables = tables_for([ha("shop")], {"shop": up(*ALL)})
    query = parse_query(dns.message.make_query(f"shop.{ZONE}", "A").to_wire())
    assert answer(tables, query) is answer(tables, query)

