"""Signed queries answered signed (RFC 8945 §5.3), the replay cache, and budgets charged after verification."""

from __future__ import annotations

import base64
import time
from unittest import mock

import dns.message
import dns.rcode
import dns.tsig
import dns.update
import pytest
from prometheus_client import CollectorRegistry

from region_agent.globaldns.acme.limits import UpdateBudgets
from region_agent.globaldns.acme.replay import ReplayCache, Seen
from region_agent.globaldns.acme.service import AcmeConfig, AcmeUpdates
from region_agent.globaldns.acme.tsig import KeySpec, TsigKeyring
from region_agent.globaldns.answer import Responder
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.tables import ZoneHolder
from region_agent.state.hlc import HybridClock
from region_agent.state.store import Store
from tests.fakes.dns_client import TsigKey, signed, txt_update
from tests.globaldns.zones import ALL, ZONE, ha, tables_for, up

SECRET = base64.b64encode(b"cert-manager-secret-0123456789ab").decode()
MD5_SECRET = base64.b64encode(b"an-older-md5-key-0123456789abcde").decode()
WRONG = base64.b64encode(b"w" * 32).decode()
SHA256 = TsigKey("acme-key", SECRET)
MD5 = TsigKey("cm-md5", MD5_SECRET, dns.tsig.HMAC_MD5)
CHALLENGE = f"_acme-challenge.{ZONE}."


def _acme(**config: object) -> tuple[AcmeUpdates, Responder, CollectorRegistry]:
    keyring = TsigKeyring([KeySpec("acme-key", "hmac-sha256", SECRET), KeySpec("cm-md5", "hmac-md5", MD5_SECRET)])
    store = Store(writer="acme/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    holder = ZoneHolder(tables_for([ha("shop")], {"shop": up(*ALL)}))
    registry = CollectorRegistry()
    acme = AcmeUpdates(store, holder, AcmeConfig(ZONE, keyring, "acme/t", **config), registry)  # type: ignore[arg-type]
    responder = Responder(holder, DnsCounters())
    responder.updates = acme.handle
    return acme, responder, registry


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _soa_query(key: TsigKey) -> dns.message.QueryMessage:
    query = dns.message.make_query(ZONE, "SOA", use_edns=0)
    query.flags = 0  # certbot clears RD
    return signed(query, key)


@pytest.mark.parametrize("key", [SHA256, MD5], ids=["sha256", "md5"])
@pytest.mark.parametrize("tcp", [False, True])
def test_a_signed_soa_query_gets_the_soa_signed_with_its_key(key: TsigKey, tcp: bool) -> None:
    _, responder, registry = _acme()
    query = _soa_query(key)
    wire = responder.respond(query.to_wire(), "127.0.0.1", tcp=tcp)
    assert wire is not None
    response = dns.message.from_wire(wire, keyring=query.keyring, request_mac=query.mac)  # verifies the MAC
    assert response.had_tsig and response.rcode() == dns.rcode.NOERROR
    assert response.answer[0].rdtype == dns.rdatatype.SOA and response.flags & dns.flags.AA
    assert _sample(registry, "region_agent_dns_signed_queries_total", result="ok") == 1


def test_a_signed_query_for_another_name_gets_the_unsigned_answer_signed() -> None:
    _, responder, _ = _acme()
    query = signed(dns.message.make_query(f"nothing.{ZONE}", "TXT", use_edns=0), SHA256)
    wire = responder.respond(query.to_wire(), "127.0.0.1", tcp=False)
    assert wire is not None
    response = dns.message.from_wire(wire, keyring=query.keyring, request_mac=query.mac)
    assert response.rcode() == dns.rcode.NXDOMAIN and response.authority[0].rdtype == dns.rdatatype.SOA


def _tsig_error(wire: bytes) -> tuple[int, int, bytes]:
    """(rcode, TSIG error, MAC) of a response, read without verifying it."""
    response = dns.message.from_wire(wire, keyring=False)
    assert response.tsig is not None
    return response.rcode(), response.tsig[0].error, response.tsig[0].mac


@pytest.mark.parametrize(("key", "error", "name"), [(TsigKey("acme-key", WRONG), dns.rcode.BADSIG, "badsig"),
                                                    (TsigKey("nobody", SECRET), dns.rcode.BADKEY, "badkey")],
                         ids=["badsig", "badkey"])
def test_a_badly_signed_query_gets_notauth_with_the_error_unsigned(key: TsigKey, error: int, name: str) -> None:
    _, responder, registry = _acme()
    wire = responder.respond(_soa_query(key).to_wire(), "127.0.0.1", tcp=False)
    assert wire is not None
    assert _tsig_error(wire) == (dns.rcode.NOTAUTH, error, b"")  # §5.3.2: no MAC
    assert _sample(registry, "region_agent_dns_signed_queries_total", result=f"tsig-{name}") == 1


def test_a_stale_signed_query_gets_badtime_signed_with_the_server_time() -> None:
    _, responder, _ = _acme()
    with mock.patch("time.time", return_value=time.time() - 3600):
        query = _soa_query(SHA256)
        stale = query.to_wire()
    wire = responder.respond(stale, "127.0.0.1", tcp=False)
    assert wire is not None
    with pytest.raises(dns.tsig.PeerBadTime):  # a valid MAC over an error: the client knows it is us
        dns.message.from_wire(wire, keyring=query.keyring, request_mac=query.mac)
    assert _tsig_error(wire)[:2] == (dns.rcode.NOTAUTH, dns.rcode.BADTIME)


def test_a_fudge_wider_than_300_seconds_does_not_widen_the_window() -> None:
    _, responder, _ = _acme()
    with mock.patch("time.time", return_value=time.time() - 400):
        query = signed(dns.message.make_query(ZONE, "SOA"), SHA256, fudge=3600)
        wire = query.to_wire()
    response = responder.respond(wire, "127.0.0.1", tcp=False)
    assert response is not None and _tsig_error(response)[:2] == (dns.rcode.NOTAUTH, dns.rcode.BADTIME)


def _update_wire(action: str, value: str, key: TsigKey = SHA256) -> bytes:
    return signed(txt_update(ZONE, CHALLENGE, action, value), key).to_wire()  # type: ignore[arg-type]


@pytest.mark.parametrize("action", ["add", "delete"])
def test_a_replayed_update_is_refused_and_changes_nothing(action: str) -> None:
    acme, responder, registry = _acme()
    if action == "delete":
        assert responder.respond(_update_wire("add", "token"), "127.0.0.1", tcp=False) is not None
    captured = _update_wire(action, "token")
    first = responder.respond(captured, "127.0.0.1", tcp=False)
    assert first is not None and dns.message.from_wire(first, keyring=False).rcode() == dns.rcode.NOERROR
    if action == "delete":  # the attacker's aim: the old value back after the client deleted it
        responder.respond(_update_wire("add", "token"), "127.0.0.1", tcp=False)
        responder.respond(_update_wire("delete", "token"), "127.0.0.1", tcp=False)
    digest = acme.store.digest()
    replays = _sample(registry, "region_agent_dns_tsig_replays_total")
    again = responder.respond(captured, "127.0.0.1", tcp=False)
    assert again is not None
    response = dns.message.from_wire(again, keyring=SHA256.keyring(), request_mac=dns.message.from_wire(
        captured, keyring=SHA256.keyring()).mac)  # refused, and signed: the request was authentic
    assert response.rcode() == dns.rcode.REFUSED
    assert acme.store.digest() == digest
    assert _sample(registry, "region_agent_dns_tsig_replays_total") == replays + 1
    assert _sample(registry, "region_agent_dns_updates_total", result="replay") == 1


def test_a_replayed_signed_query_is_refused() -> None:
    _, responder, registry = _acme()
    wire = _soa_query(SHA256).to_wire()
    responder.respond(wire, "127.0.0.1", tcp=True)
    again = responder.respond(wire, "127.0.0.1", tcp=True)
    assert again is not None and dns.message.from_wire(again, keyring=False).rcode() == dns.rcode.REFUSED
    assert _sample(registry, "region_agent_dns_signed_queries_total", result="replay") == 1


def test_the_replay_cache_is_bounded_and_forgets_after_the_window() -> None:
    now = [1_000_000.0]
    cache = ReplayCache(capacity=100, clock=lambda: now[0])
    seen = [cache.check("acme-key.", n.to_bytes(32, "big"), int(now[0])) for n in range(150)]
    assert seen.count(Seen.FRESH) == 100 and seen[100:] == [Seen.FULL] * 50 and len(cache) == 100
    assert cache.check("ACME-key.", (0).to_bytes(32, "big"), int(now[0])) is Seen.REPLAY  # names case-blind
    now[0] += 300 + 30  # past time signed + fudge + margin: such a message is BADTIME now
    assert cache.check("acme-key.", b"new", int(now[0])) is Seen.FRESH and len(cache) == 1


def test_a_full_replay_cache_refuses_rather_than_forgets() -> None:
    acme, responder, registry = _acme(replay_capacity=2)
    rcodes = []
    for n in range(3):
        wire = responder.respond(_update_wire("add", f"v{n}"), "127.0.0.1", tcp=False)
        assert wire is not None
        rcodes.append(dns.message.from_wire(wire, keyring=False).rcode())
    assert rcodes == [dns.rcode.NOERROR, dns.rcode.NOERROR, dns.rcode.REFUSED]
    assert _sample(registry, "region_agent_dns_updates_total", result="replay-cache-full") == 1
    assert len(acme.replays) == 2


def test_budgets_junk_spends_only_its_own_and_keys_and_sources_are_apart() -> None:
    now = [0.0]
    budgets = UpdateBudgets(1.0, 2, monotonic=lambda: now[0])
    assert [budgets.take_unverified() for _ in range(3)] == [True, True, False]
    assert budgets.take_signed("a.", "192.0.2.1") is None  # junk spent nothing of this
    assert budgets.take_signed("a.", "192.0.2.2") is None
    assert budgets.take_signed("a.", "192.0.2.3") == "key"
    assert budgets.take_signed("b.", "192.0.2.1") is None
    assert budgets.take_signed("c.", "192.0.2.1") == "source"
    now[0] += 1.0
    assert budgets.take_signed("a.", "192.0.2.3") is None and budgets.take_unverified()


def test_unsigned_junk_past_its_budget_gets_a_bare_refused_and_signed_updates_still_work() -> None:
    acme, responder, registry = _acme(updates_per_second=0.001, burst=2)
    junk = txt_update(ZONE, CHALLENGE, "add", "junk").to_wire()
    answers = [responder.respond(junk, "127.0.0.1", tcp=False) for _ in range(5)]
    assert [a is not None and len(a) for a in answers[2:]] == [12, 12, 12]  # header only: nothing parsed
    assert _sample(registry, "region_agent_dns_update_limited_total", budget="unverified") == 3
    ok = responder.respond(_update_wire("add", "token"), "127.0.0.1", tcp=False)
    assert ok is not None and dns.message.from_wire(ok, keyring=False).rcode() == dns.rcode.NOERROR
    assert acme.store.challenges


def test_replays_spend_the_unverified_budget_not_the_keys() -> None:
    _, responder, registry = _acme(updates_per_second=0.001, burst=2)
    captured = _update_wire("add", "token")
    answers = [responder.respond(captured, "127.0.0.1", tcp=False) for _ in range(4)]
    sizes = [len(a) if a is not None else 0 for a in answers]
    assert sizes[1] > 12 and sizes[2] > 12 and sizes[3] == 12  # signed REFUSED twice, then the bare one
    assert _sample(registry, "region_agent_dns_tsig_replays_total") == 3
    ok = responder.respond(_update_wire("add", "other"), "127.0.0.1", tcp=False)  # the key's budget is untouched
    assert ok is not None and dns.message.from_wire(ok, keyring=False).rcode() == dns.rcode.NOERROR
