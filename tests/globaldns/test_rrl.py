"""Response rate limiting: the limiter's table with a fake clock, the Responder's use of it, and a
spoofed-source flood over real UDP sockets bound to loopback addresses of two /24s."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import dns.flags
import dns.message
import dns.rcode
import pytest

from region_agent.base.clock import ManualClock
from region_agent.globaldns.answer import Responder
from region_agent.globaldns.metrics import DnsCollector, DnsCounters
from region_agent.globaldns.rrl import DROP, ERROR, NXDOMAIN, PASS, RESPONSE, SLIP, RateLimiter, RrlConfig
from region_agent.globaldns.server import DnsServer
from region_agent.globaldns.service import rate_limiter
from region_agent.globaldns.settings import RrlSettings
from region_agent.globaldns.tables import ZoneHolder
from region_agent.state.model import AllDownPolicy
from tests.conftest import wait_for
from tests.fakes.dns_client import query_wire
from tests.globaldns.zones import ALL, ZONE, down, ha, tables_for, up

P, D, S = PASS, DROP, SLIP


def _limiter(rate: float = 5, *, slip: int = 2, window: float = 15, max_buckets: int = 100_000,
             nx: float | None = None, errors: float | None = None) -> tuple[RateLimiter, ManualClock]:
    clock = ManualClock()
    config = RrlConfig(rate, nx or rate, errors or rate, window=window, slip=slip, max_buckets=max_buckets)
    return RateLimiter(config, clock.monotonic), clock


def _burst(limiter: RateLimiter, n: int, source: str = "192.0.2.1", kind: int = RESPONSE, name: bytes = b"\x04shop",
           qtype: int = 1) -> list[int]:
    return [limiter.check(source, kind, name, qtype) for _ in range(n)]


@pytest.mark.parametrize(("slip", "expected"), [
    (2, [P] * 5 + [D, S, D, S, D, S]),
    (3, [P] * 5 + [D, D, S, D, D, S]),
    (1, [P] * 5 + [S] * 6),
    (0, [P] * 5 + [D] * 6),
], ids=["slip 2", "slip 3", "slip 1: all TC", "slip 0: all dropped"])
def test_a_burst_passes_the_rate_then_slips_every_nth(slip: int, expected: list[int]) -> None:
    limiter, _ = _limiter(5, slip=slip)
    assert _burst(limiter, 11) == expected


def test_credit_is_capped_at_one_second() -> None:
    limiter, clock = _limiter(5)
    clock.advance(3600)  # a quiet hour earns no more than one second's worth
    assert _burst(limiter, 7) == [P] * 5 + [D, S]


def test_steady_traffic_at_the_rate_is_never_limited() -> None:
    limiter, clock = _limiter(5)
    for _ in range(500):
        clock.advance(0.2)
        assert limiter.check("192.0.2.1", RESPONSE, b"\x04shop", 1) == PASS


@pytest.mark.parametrize(("quiet", "first"), [(14.0, D), (15.3, P)], ids=["inside the window", "after the window"])
def test_debt_is_capped_at_the_window(quiet: float, first: int) -> None:
    limiter, clock = _limiter(5, window=15, slip=0)
    _burst(limiter, 10_000)  # a long flood: debt stops at 15 s x 5/s
    clock.advance(quiet)
    assert limiter.check("192.0.2.1", RESPONSE, b"\x04shop", 1) == first


def test_buckets_are_per_name_and_type_for_answers() -> None:
    limiter, _ = _limiter(2, slip=0)
    assert _burst(limiter, 3, name=b"\x04shop", qtype=1) == [P, P, D]
    assert _burst(limiter, 3, name=b"\x04shop", qtype=28) == [P, P, D]
    assert _burst(limiter, 3, name=b"\x04cart", qtype=1) == [P, P, D]


def test_nxdomain_and_errors_have_their_own_rates_and_ignore_the_name() -> None:
    limiter, _ = _limiter(10, nx=2, errors=3, slip=0)
    names = [f"{i:x}".encode() for i in range(4)]  # a random-subdomain flood shares the zone's bucket
    assert [limiter.check("192.0.2.1", NXDOMAIN, b"zone") for _ in names] == [P, P, D, D]
    assert [limiter.check("192.0.2.1", ERROR, name, 1) for name in names] == [P, P, P, D]
    assert _burst(limiter, 10) == [P] * 10  # answers are not charged for the errors


@pytest.mark.parametrize(("a", "b", "shared"), [
    ("192.0.2.1", "192.0.2.254", True),
    ("192.0.2.1", "192.0.3.1", False),
    ("192.0.2.1", "::ffff:192.0.2.77", True),
    ("2001:db8:0:ff::1", "2001:db8:0:1::2", True),  # the same /56
    ("2001:db8:0:ff::1", "2001:db8:0:100::1", False),
    ("2001:db8::1", "32.1.13.184", False),  # IPv6 networks never collide with IPv4 ones
    ("fe80::1%eth0", "fe80::2", True),
])
def test_clients_are_grouped_by_network(a: str, b: str, shared: bool) -> None:
    limiter, _ = _limiter(3, slip=0)
    _burst(limiter, 3, source=a)
    assert limiter.check(b, RESPONSE, b"\x04shop", 1) == (D if shared else P)


def test_the_table_is_bounded_and_keeps_the_recently_used() -> None:
    limiter, _ = _limiter(1, slip=0, max_buckets=100)
    assert _burst(limiter, 2, source="198.51.100.1") == [P, D]
    for i in range(10_000):  # a flood spoofing 10,000 networks
        limiter.check(f"10.{i // 256}.{i % 256}.1", RESPONSE, b"\x04shop", 1)
        if i % 50 == 0:
            assert limiter.check("198.51.100.1", RESPONSE, b"\x04shop", 1) == DROP  # still remembered
    assert len(limiter.buckets) == 100


def test_settings_make_no_limiter_by_default_and_fill_in_the_rates() -> None:
    assert rate_limiter(RrlSettings()) is None
    limiter = rate_limiter(RrlSettings(responses_per_second=10, errors_per_second=5))
    assert limiter is not None
    config = limiter.config
    assert (config.responses_per_second, config.nxdomains_per_second, config.errors_per_second) == (10, 10, 5)
    assert (config.window, config.slip, config.ipv4_prefix, config.ipv6_prefix) == (15, 2, 24, 56)


# ---------------------------------------------------------------- through the Responder


def _responder(rate: float = 3, slip: int = 2) -> tuple[Responder, ManualClock]:
    limiter, clock = _limiter(rate, slip=slip)
    holder = ZoneHolder(tables_for([ha("shop")], {"shop": up(*ALL)}))
    return Responder(holder, DnsCounters(), rrl=limiter), clock


def _wire(name: str, qid: int = 1) -> bytes:
    return query_wire(name, qid=qid, use_edns=0, payload=1232)


def test_responder_limits_udp_answers_memo_hits_included_and_never_tcp() -> None:
    responder, _ = _responder(3)
    outs = [responder.respond(_wire(f"shop.{ZONE}", i), "192.0.2.1", tcp=False) for i in range(7)]
    full = [o for o in outs if o is not None and not dns.message.from_wire(o).flags & dns.flags.TC]
    slipped = [dns.message.from_wire(o) for o in outs if o is not None and o not in full]
    assert len(full) == 3 and outs[3] is None and len(slipped) == 2
    for i, response in zip((4, 6), slipped, strict=True):
        assert response.id == i and response.flags & dns.flags.TC and not response.answer
        assert response.question[0].name.to_text() == f"shop.{ZONE}." and response.opt is not None
    assert responder.counters.memo_hits == 2  # the first three: a miss, then two hits
    assert responder.counters.rrl_actions == [3, 2, 2]
    for i in range(20):
        out = responder.respond(_wire(f"shop.{ZONE}", i), "192.0.2.1", tcp=True)
        assert out is not None and dns.message.from_wire(out).answer
    assert responder.counters.rrl_actions == [3, 2, 2]  # TCP is not even counted


def test_responder_keys_nxdomain_by_zone_and_errors_by_client() -> None:
    responder, _ = _responder(3, slip=0)
    outs = [responder.respond(_wire(f"r{i}.{ZONE}"), "192.0.2.1", tcp=False) for i in range(5)]
    assert [o is not None for o in outs] == [True] * 3 + [False] * 2
    outs = [responder.respond(_wire(f"r{i}.example.org"), "192.0.2.1", tcp=False) for i in range(5)]  # REFUSED
    assert [o is not None for o in outs] == [True] * 3 + [False] * 2
    malformed = _wire(f"shop.{ZONE}") + b"\x00"  # FORMERR: the same error bucket, now empty
    assert responder.respond(malformed, "192.0.2.1", tcp=False) is None
    assert responder.respond(_wire(f"shop.{ZONE}"), "192.0.2.1", tcp=False) is not None  # answers: own bucket


def test_a_slipped_error_is_the_error_with_tc_set() -> None:
    responder, _ = _responder(1, slip=1)
    malformed = _wire(f"shop.{ZONE}") + b"\x00"
    responder.respond(malformed, "192.0.2.1", tcp=False)
    out = responder.respond(malformed, "192.0.2.1", tcp=False)
    assert out is not None and out[2] & 0x02 and out[3] & 0x0F == dns.rcode.FORMERR


# ---------------------------------------------------------------- spoofed-source flood on loopback


FLOODERS = [f"127.0.5.{i}" for i in range(1, 21)]  # one /24
BYSTANDER = "127.0.9.1"  # another /24
RATE, PER_FLOODER = 5, 25


@pytest.fixture
async def limited_server() -> AsyncIterator[tuple[DnsServer, DnsCounters]]:
    counters = DnsCounters()
    holder = ZoneHolder(tables_for([ha("shop")], {"shop": up(*ALL)}))
    limiter = RateLimiter(RrlConfig(RATE, RATE, RATE, window=15, slip=2))
    server = DnsServer(Responder(holder, counters, rrl=limiter), [("127.0.0.1", 0)])
    await server.start()
    yield server, counters
    await server.stop()


def _socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, 0))
    sock.setblocking(False)
    return sock


def _drain(sock: socket.socket) -> list[dns.message.Message]:
    out = []
    while True:
        try:
            out.append(dns.message.from_wire(sock.recv(4096)))
        except BlockingIOError:
            return out


async def test_a_spoofed_flood_is_limited_to_its_network_and_others_are_untouched(
        limited_server: tuple[DnsServer, DnsCounters]) -> None:
    server, counters = limited_server
    target = ("127.0.0.1", server.bound[0][1])
    flooders = [_socket(a) for a in FLOODERS]
    bystander = _socket(BYSTANDER)
    try:
        sent = 0
        for round_ in range(PER_FLOODER):
            for sock in flooders:
                sock.sendto(_wire(f"shop.{ZONE}", sent & 0xFFFF), target)
                sent += 1
            if round_ % 5 == 0:
                bystander.sendto(_wire(f"shop.{ZONE}", 60000 + round_), target)
                sent += 1
        await wait_for(lambda: sum(counters.rrl_actions) == sent, timeout=10, message="every query seen")
        passed, dropped, slipped = counters.rrl_actions
        received: dict[str, list[dns.message.Message]] = {}

        def all_received() -> bool:
            for sock in [*flooders, bystander]:
                received.setdefault(sock.getsockname()[0], []).extend(_drain(sock))
            return sum(len(v) for v in received.values()) == passed + slipped

        await wait_for(all_received, timeout=10, message="every answer received")
        flood = [m for a in FLOODERS for m in received[a]]
        flood_full = [m for m in flood if not m.flags & dns.flags.TC]
        flood_tc = [m for m in flood if m.flags & dns.flags.TC]
        # the flooded /24 got its rate (a burst of 5, plus 5/s for however long the test ran: well under 2 s)
        assert RATE <= len(flood_full) <= 3 * RATE
        assert all(not m.answer for m in flood_tc) and abs(len(flood_tc) - dropped) <= 1
        assert len(flood) + dropped == len(FLOODERS) * PER_FLOODER  # what was not answered was dropped
        # the other /24 got every answer, in full
        assert len(received[BYSTANDER]) == PER_FLOODER // 5
        assert all(m.answer and not m.flags & dns.flags.TC for m in received[BYSTANDER])
    finally:
        for sock in [*flooders, bystander]:
            sock.close()


def test_actions_are_exported_by_label() -> None:
    counters = DnsCounters()
    counters.rrl_actions = [7, 3, 2]
    family = next(f for f in DnsCollector(counters).collect() if f.name == "region_agent_dns_rrl_actions")
    assert {s.labels["action"]: s.value for s in family.samples if s.name.endswith("_total")} == {
        "pass": 7, "drop": 3, "slip": 2}


def test_a_memoised_servfail_is_charged_as_an_error_on_hits_too() -> None:
    limiter, _ = _limiter(100, errors=2, slip=0)
    tables = tables_for([ha("dead", AllDownPolicy.SERVFAIL)], {"dead": down(*ALL)})
    responder = Responder(ZoneHolder(tables), DnsCounters(), rrl=limiter)
    outs = [responder.respond(_wire(f"dead.{ZONE}", i), "192.0.2.1", tcp=False) for i in range(4)]
    assert [o is not None for o in outs] == [True, True, False, False]
    assert dns.message.from_wire(outs[0] or b"").rcode() == dns.rcode.SERVFAIL
    assert responder.counters.memo_hits == 1  # the second answer came from the memo, in the same bucket
