"""RFC 2136 UPDATE of ACME challenges and its TSIG: decisions from real dnspython messages."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Callable
from unittest import mock

import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.tsig
import dns.update
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from region_agent.globaldns.acme.tsig import KeySpec, TsigConfigError, TsigKeyring, Verdict, respond, verify
from region_agent.globaldns.acme.update import UpdateLimits, UpdatePlan, ZoneFacts, plan_update
from tests.fakes import dns_client

APEX = dns.name.from_text("g.example.com")
SECRET = base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
KEYRING = TsigKeyring([KeySpec("acme-key", "HMACSHA256", SECRET), KeySpec("old-key", "hmac-md5", SECRET)])
CHALLENGE = "_acme-challenge.g.example.com."


def _txt(value: str) -> bytes:
    wire = dns.rdata.from_text(dns.rdataclass.IN, dns.rdatatype.TXT, f'"{value}"').to_wire()
    assert wire is not None
    return wire


def _update(*, zone: str = "g.example.com") -> dns.update.UpdateMessage:
    return dns.update.UpdateMessage(zone)


def _signed(message: dns.update.UpdateMessage, name: str = "acme-key", secret: str = SECRET,
            algorithm: dns.name.Name = dns.tsig.HMAC_SHA256) -> bytes:
    return dns_client.signed(message, dns_client.TsigKey(name, secret, algorithm)).to_wire()


def _parsed(message: dns.message.Message) -> dns.message.Message:
    """As the server sees it: from the wire (dnspython marks deletions only on parsed messages)."""
    return dns.message.from_wire(message.to_wire())


def _plan(message: dns.message.Message, records: dict[str, dict[bytes, int]] | None = None,
          **limits: int) -> UpdatePlan:
    return plan_update(_parsed(message), APEX, records or {}, limits=UpdateLimits(**limits))


def test_cert_manager_present_and_cleanup() -> None:
    present = _update()
    present.add(CHALLENGE, 60, "TXT", '"key-a"')
    plan = _plan(present)
    assert (plan.rcode, plan.adds, plan.removes) == (dns.rcode.NOERROR, [(CHALLENGE, _txt("key-a"), 60)], [])
    records = {CHALLENGE: {_txt("key-a"): 60, _txt("key-b"): 60}}
    cleanup = _update()
    cleanup.delete(CHALLENGE, "TXT", '"key-a"')  # class NONE, as cert-manager's REMOVE
    plan = _plan(cleanup, records)
    assert (plan.rcode, plan.adds, plan.removes) == (dns.rcode.NOERROR, [], [(CHALLENGE, _txt("key-a"))])


def test_delete_rrset_and_name_and_a_ttl_change() -> None:
    records = {CHALLENGE: {_txt("a"): 60, _txt("b"): 60}}
    whole = _update()
    whole.delete(CHALLENGE, "TXT")
    assert sorted(_plan(whole, records).removes) == sorted([(CHALLENGE, _txt("a")), (CHALLENGE, _txt("b"))])
    name = _update()
    name.delete(CHALLENGE)
    assert len(_plan(name, records).removes) == 2
    again = _update()
    again.add(CHALLENGE, 120, "TXT", '"a"')
    assert _plan(again, records).adds == [(CHALLENGE, _txt("a"), 120)]


@pytest.mark.parametrize(("build", "rcode", "reason"), [
    (lambda u: u.add("www.g.example.com.", 60, "TXT", '"x"'), dns.rcode.REFUSED, "refused-name"),
    (lambda u: u.add("_acme-challenge.g.example.com.", 60, "A", "192.0.2.1"), dns.rcode.REFUSED, "refused-type"),
    (lambda u: u.add("g.example.com.", 60, "NS", "ns.evil.example."), dns.rcode.REFUSED, "refused-name"),
    (lambda u: u.delete("g.example.com.", "SOA"), dns.rcode.REFUSED, "refused-name"),
    (lambda u: u.add("_acme-challenge.other.example.", 60, "TXT", '"x"'), dns.rcode.NOTZONE, "notzone"),
    (lambda u: u.add("x._acme-challenge.g.example.com.", 60, "TXT", '"x"'), dns.rcode.REFUSED, "refused-name"),
])
def test_only_challenge_txt_may_change(build, rcode: int, reason: str) -> None:  # type: ignore[no-untyped-def]
    update = _update()
    update.add(CHALLENGE, 60, "TXT", '"fine"')
    build(update)
    plan = _plan(update)
    assert (plan.rcode, plan.reason, plan.changes) == (rcode, reason, 0)


def test_custom_domain_challenges_are_in_policy() -> None:
    update = _update()
    update.add("_acme-challenge.d-3f2a9c.g.example.com.", 60, "TXT", '"k"')
    assert _plan(update).rcode == dns.rcode.NOERROR


def test_another_zone_is_notauth() -> None:
    update = _update(zone="example.com")
    update.add("_acme-challenge.example.com.", 60, "TXT", '"k"')
    assert _plan(update).rcode == dns.rcode.NOTAUTH


@pytest.mark.parametrize(("limits", "count", "size"), [
    ({"max_value_length": 20}, 1, 40), ({"max_per_name": 2}, 3, 10), ({"max_total": 2}, 3, 10)])
def test_limits_refuse_the_whole_update(limits: dict[str, int], count: int, size: int) -> None:
    update = _update()
    for n in range(count):
        update.add(CHALLENGE, 60, "TXT", f'"{str(n) * size}"')
    plan = plan_update(_parsed(update), APEX, {}, limits=UpdateLimits(**limits))
    assert (plan.rcode, plan.reason, plan.changes) == (dns.rcode.REFUSED, "over-limit", 0)


@pytest.mark.parametrize("ttl", [86_401, 2**31 - 1])
def test_a_ttl_beyond_a_day_is_refused_and_changes_nothing(ttl: int) -> None:
    """Any TTL up to 2^31-1 was taken (a challenge cached for 68 years); 2^31 and above is read as 0 on the
    wire (RFC 2181 §8), which is in bounds."""
    update = _update()
    update.add(CHALLENGE, ttl, "TXT", '"k"')
    plan = plan_update(_parsed(update), APEX, {})
    assert (plan.rcode, plan.reason, plan.changes) == (dns.rcode.REFUSED, "over-limit", 0)
    update = _update()
    update.add(CHALLENGE, 86_400, "TXT", '"k"')
    assert plan_update(_parsed(update), APEX, {}).rcode == dns.rcode.NOERROR


def test_prerequisites_of_every_class() -> None:
    records = {CHALLENGE: {_txt("a"): 60}}
    facts = ZoneFacts(lambda name: name == "shop.g.example.com.", lambda name, rdtype: frozenset({b"x"})
                      if (name, rdtype) == ("shop.g.example.com.", dns.rdatatype.A) else None)
    cases: list[tuple[Callable[[dns.update.UpdateMessage], None], int]] = [
        (lambda u: u.present(CHALLENGE), dns.rcode.NOERROR),                      # name in use
        (lambda u: u.present("nope.g.example.com."), dns.rcode.NXDOMAIN),
        (lambda u: u.present("shop.g.example.com.", "A"), dns.rcode.NOERROR),     # RRset exists
        (lambda u: u.present(CHALLENGE, "A"), dns.rcode.NXRRSET),
        (lambda u: u.absent("nope.g.example.com."), dns.rcode.NOERROR),           # name not in use
        (lambda u: u.absent("shop.g.example.com."), dns.rcode.YXDOMAIN),
        (lambda u: u.absent(CHALLENGE, "TXT"), dns.rcode.YXRRSET),                 # RRset does not exist
        (lambda u: u.present(CHALLENGE, "TXT", '"a"'), dns.rcode.NOERROR),        # value-dependent
        (lambda u: u.present(CHALLENGE, "TXT", '"b"'), dns.rcode.NXRRSET),
        (lambda u: u.present("x.other.example."), dns.rcode.NOTZONE),
    ]
    for build, rcode in cases:
        update = _update()
        build(update)
        update.add(CHALLENGE, 60, "TXT", '"new"')
        plan = plan_update(_parsed(update), APEX, records, zone=facts)
        assert plan.rcode == rcode, (build, plan.reason)
        assert (plan.changes > 0) == (rcode == dns.rcode.NOERROR)


def test_a_signed_update_is_verified_and_the_response_signed() -> None:
    update = _update()
    update.add(CHALLENGE, 60, "TXT", '"k"')
    verified = verify(_signed(update), KEYRING)
    assert verified.verdict is Verdict.OK
    wire = respond(verified, dns.rcode.NOERROR)
    keyring = dns_client.TsigKey("acme-key", SECRET, dns.tsig.HMAC_SHA256).keyring()
    response = dns.message.from_wire(wire, keyring=keyring, request_mac=verified.message.mac)
    assert response.rcode() == dns.rcode.NOERROR and response.had_tsig


def test_an_older_key_of_another_algorithm_still_verifies() -> None:
    update = _update()
    update.add(CHALLENGE, 60, "TXT", '"k"')
    assert verify(_signed(update, "old-key", algorithm=dns.tsig.HMAC_MD5), KEYRING).verdict is Verdict.OK


def _tsig_error(wire: bytes) -> tuple[int, int, int]:
    """(rcode, TSIG error, MAC length) of a response, read without verifying it."""
    response = dns.message.from_wire(wire, keyring=False)
    assert response.tsig is not None
    return response.rcode(), response.tsig[0].error, len(response.tsig[0].mac)


def test_unsigned_unknown_key_bad_mac_wrong_algorithm_and_stale_time() -> None:
    update = _update()
    update.add(CHALLENGE, 60, "TXT", '"k"')
    unsigned = verify(update.to_wire(), KEYRING)
    assert unsigned.verdict is Verdict.UNSIGNED
    assert dns.message.from_wire(respond(unsigned, dns.rcode.NOTAUTH)).rcode() == dns.rcode.NOTAUTH

    unknown = verify(_signed(_with_add(), "stranger"), KEYRING)
    assert unknown.verdict is Verdict.BADKEY
    assert _tsig_error(respond(unknown, dns.rcode.NOTAUTH)) == (dns.rcode.NOTAUTH, dns.rcode.BADKEY, 0)

    forged = verify(_signed(_with_add(), secret=base64.b64encode(b"f" * 32).decode()), KEYRING)
    assert forged.verdict is Verdict.BADSIG
    assert _tsig_error(respond(forged, dns.rcode.NOTAUTH)) == (dns.rcode.NOTAUTH, dns.rcode.BADSIG, 0)

    wrong_algorithm = verify(_signed(_with_add(), algorithm=dns.tsig.HMAC_SHA512), KEYRING)
    assert wrong_algorithm.verdict is Verdict.BADKEY

    with mock.patch("time.time", return_value=time.time() - 3600):
        stale_wire = _signed(_with_add())
    stale = verify(stale_wire, KEYRING)
    assert stale.verdict is Verdict.BADTIME
    rcode, error, mac = _tsig_error(respond(stale, dns.rcode.NOTAUTH))
    assert (rcode, error) == (dns.rcode.NOTAUTH, dns.rcode.BADTIME) and mac == 32  # signed, SHA-256
    other = dns.message.from_wire(respond(stale, dns.rcode.NOTAUTH), keyring=False).tsig[0].other  # type: ignore[index]
    high, low = struct.unpack("!HI", other)
    assert abs((high << 32 | low) - time.time()) < 5  # the server's time, for the client's clock


def _with_add() -> dns.update.UpdateMessage:
    update = _update()
    update.add(CHALLENGE, 60, "TXT", '"k"')
    return update


@pytest.mark.parametrize("spec", [
    KeySpec("k", "hmac-sha384-nope", SECRET), KeySpec("k", "hmac-sha256", "not base64!"),
    KeySpec("k", "hmac-sha256", base64.b64encode(b"short").decode())])
def test_bad_keys_are_refused_at_start(spec: KeySpec) -> None:
    with pytest.raises(TsigConfigError, match="TSIG key 'k'"):
        TsigKeyring([spec])


def _tsig_cases() -> list[bytes]:
    signed = _signed(_with_add())
    (arcount,) = struct.unpack_from("!H", signed, 10)
    tsig_at = signed.rindex(b"\x08acme-key\x00")
    tsig = signed[tsig_at:]
    body = signed[:tsig_at]
    return [
        signed[:-7],                                                             # truncated TSIG
        body[:10] + struct.pack("!H", arcount + 1) + body[12:] + tsig + tsig,    # two TSIGs
        body,                                                                     # TSIG counted, missing
        signed.replace(b"\x00\x20", b"\xff\xff", 1),                             # huge MAC size
    ]


@pytest.mark.parametrize("wire", _tsig_cases())
def test_malformed_tsig_is_refused_cleanly(wire: bytes) -> None:
    from region_agent.globaldns.acme.tsig import UnparseableError

    try:
        verified = verify(wire, KEYRING)
    except UnparseableError:
        return
    assert verified.verdict is not Verdict.OK
    assert dns.message.from_wire(respond(verified, dns.rcode.NOTAUTH), keyring=False).rcode() == dns.rcode.NOTAUTH


@given(st.binary(max_size=300), st.integers(min_value=0, max_value=400), st.binary(max_size=8))
@settings(max_examples=300, deadline=None)
def test_fuzzed_updates_never_raise_anything_else(prefix: bytes, cut: int, junk: bytes) -> None:
    from region_agent.globaldns.acme.tsig import UnparseableError

    base = _signed(_with_add())
    for wire in (prefix, base[:cut] + junk + base[cut + len(junk):]):
        try:
            verified = verify(wire, KEYRING)
        except UnparseableError:
            continue
        if verified.message.opcode() == dns.opcode.UPDATE:
            plan_update(verified.message, APEX, {})
        respond(verified, dns.rcode.NOTAUTH)


def test_a_response_is_never_answered() -> None:
    from region_agent.globaldns.acme.tsig import UnparseableError

    wire = bytearray(_signed(_with_add()))
    wire[2] |= 0x80  # QR: this is a response
    with pytest.raises(UnparseableError, match="a response"):
        verify(bytes(wire), KEYRING)
