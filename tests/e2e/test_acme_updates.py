"""ACME DNS-01 through a running agent: the real nsupdate, and dnspython sending what cert-manager sends.

The agent runs in this test's event loop on loopback ports; ``nsupdate`` and ``dig`` (Debian's
bind9-dnsutils) run as child processes without blocking it.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal
from unittest import mock

import dns.exception
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.tsig
import dns.update
import pytest

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from tests.conftest import wait_for
from tests.fakes.dns_client import TsigKey, ask, signed, txt_update, txt_values

ZONE = "g.example.com"
SECRET = base64.b64encode(b"cert-manager-secret-0123456789ab").decode()
MD5_SECRET = base64.b64encode(b"an-older-md5-key-0123456789abcde").decode()
CHALLENGE = f"_acme-challenge.{ZONE}."
ZONE_FILE = ("regions: {sfo1: {ipv4: [127.0.0.51], ns_ipv4: [127.0.0.53]}}\n"
             "projects: {shop: {regions: [sfo1]}}\n")


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE_FILE)
    running = Agent(AgentSettings(
        region="sfo1", zone_file=zone,
        dns={"zone": ZONE, "listen_addresses": ["127.0.0.1"], "port": 0,
             "acme": {"tsig_keys": [{"name": "acme-key", "algorithm": "hmac-sha256", "secret": SECRET},
                                    {"name": "cm-md5", "algorithm": "HMACMD5", "secret": MD5_SECRET}],
                      "max_records_per_name": 4}},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


def _port(agent: Agent) -> int:
    return agent.dns.server.bound[0][1]


async def _txt(agent: Agent, name: str = CHALLENGE, *, tcp: bool = False) -> tuple[int, set[str]]:
    response = await ask(_port(agent), name, "TXT", tcp=tcp)
    return response.rcode(), txt_values(response)


async def _run(*argv: str, stdin: str = "") -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(stdin.encode()), 20)
    return process.returncode or 0, out.decode()


@pytest.mark.external
@pytest.mark.skipif(shutil.which("nsupdate") is None or shutil.which("dig") is None,
                    reason="nsupdate and dig come with Debian's bind9-dnsutils (scripts/system-packages.sh)")
async def test_nsupdate_adds_and_deletes_a_challenge_that_dig_then_sees(agent: Agent) -> None:
    port = _port(agent)
    serial_before = agent.dns.tables.serial if agent.dns.tables else 0
    script = (f"server 127.0.0.1 {port}\nzone {ZONE}\n"
              f'update add {CHALLENGE} 60 TXT "token-from-nsupdate"\nsend\n')
    code, out = await _run("nsupdate", "-y", f"hmac-sha256:acme-key:{SECRET}", stdin=script)
    assert code == 0, out
    async def answered() -> bool:
        return (await _txt(agent))[1] == {"token-from-nsupdate"}
    await wait_for(answered, message="challenge answered")
    code, out = await _run("dig", "@127.0.0.1", "-p", str(port), "+short", "TXT", CHALLENGE.upper())
    assert (code, out.strip()) == (0, '"token-from-nsupdate"')
    assert agent.dns.tables is not None and agent.dns.tables.serial >= serial_before

    script = (f"server 127.0.0.1 {port}\nzone {ZONE}\n"
              f'update delete {CHALLENGE} TXT "token-from-nsupdate"\nsend\n')
    code, out = await _run("nsupdate", "-y", f"hmac-sha256:acme-key:{SECRET}", stdin=script)
    assert code == 0, out

    async def gone() -> bool:
        rcode, values = await _txt(agent)
        return rcode == dns.rcode.NXDOMAIN and not values
    await wait_for(gone, message="challenge deleted")

    code, out = await _run("nsupdate", "-y", f"hmac-sha256:acme-key:{base64.b64encode(b'x' * 32).decode()}",
                           stdin=script.replace("delete", "add").replace("TXT", "60 TXT"))
    assert (code != 0 and "NOTAUTH" in out) or "BADSIG" in out or "tsig" in out.lower(), out


def _cert_manager_update(action: Literal["add", "delete"], value: str) -> dns.update.UpdateMessage:
    """As cert-manager's RFC 2136 solver builds it (PLATFORM.md §4.1): TTL 60 add, class NONE delete, MD5."""
    return signed(txt_update(ZONE, CHALLENGE, action, value), TsigKey("cm-md5", MD5_SECRET, dns.tsig.HMAC_MD5),
                  fudge=300)


@pytest.mark.parametrize("tcp", [False, True])
async def test_cert_manager_present_and_cleanup_keep_the_other_value(agent: Agent, tcp: bool) -> None:
    for value in ("apex-token", "wildcard-token"):
        response = await ask(_port(agent), _cert_manager_update("add", value), tcp=tcp)
        assert response.rcode() == dns.rcode.NOERROR and response.had_tsig
    async def both() -> bool:
        return (await _txt(agent, tcp=tcp))[1] == {"apex-token", "wildcard-token"}
    await wait_for(both, message="both values answered")
    response = await ask(_port(agent), _cert_manager_update("delete", "apex-token"), tcp=tcp)
    assert response.rcode() == dns.rcode.NOERROR

    async def one_left() -> bool:
        return (await _txt(agent, tcp=tcp))[1] == {"wildcard-token"}
    await wait_for(one_left, message="only the other value left")


def _signed(update: dns.update.UpdateMessage, name: str = "acme-key", secret: str = SECRET,
            algorithm: dns.name.Name = dns.tsig.HMAC_SHA256) -> dns.update.UpdateMessage:
    return signed(update, TsigKey(name, secret, algorithm))


def _adding(name: str = CHALLENGE, rdtype: str = "TXT", value: str = '"v"', count: int = 1) -> dns.update.UpdateMessage:
    update = dns.update.UpdateMessage(ZONE)
    for n in range(count):
        update.add(name, 60, rdtype, value if count == 1 else f'"v{n}"')
    return update


async def test_refusals_change_nothing(agent: Agent) -> None:
    await wait_for(agent.ready.is_set, timeout=10, message="ready")
    digest = agent.store.digest()
    port = _port(agent)
    wrong = base64.b64encode(b"w" * 32).decode()
    with mock.patch("time.time", return_value=time.time() - 3600):
        stale = _signed(_adding())
        stale_wire = stale.to_wire()
    cases: list[tuple[str, bytes | dns.update.UpdateMessage, int]] = [
        ("unsigned", _adding(), dns.rcode.NOTAUTH),
        ("unknown key", _signed(_adding(), name="nobody"), dns.rcode.NOTAUTH),
        ("wrong secret", _signed(_adding(), secret=wrong), dns.rcode.NOTAUTH),
        ("wrong algorithm", _signed(_adding(), algorithm=dns.tsig.HMAC_SHA512), dns.rcode.NOTAUTH),
        ("stale time", stale_wire, dns.rcode.NOTAUTH),
        ("TXT outside _acme-challenge", _signed(_adding(f"www.{ZONE}.")), dns.rcode.REFUSED),
        ("an A record", _signed(_adding(rdtype="A", value="192.0.2.1")), dns.rcode.REFUSED),
        ("the apex NS", _signed(_adding(f"{ZONE}.", "NS", "ns.evil.example.")), dns.rcode.REFUSED),
        ("over the per-name limit", _signed(_adding(count=5)), dns.rcode.REFUSED),
        ("another zone", _signed(dns.update.UpdateMessage("example.org")), dns.rcode.NOTAUTH),
    ]
    for what, message, rcode in cases:
        wire = message if isinstance(message, bytes) else message.to_wire()
        response = await ask(port, wire)  # exactly these bytes; the reply is read without checking its TSIG
        assert response.rcode() == rcode, what
        assert agent.store.digest() == digest, what
    assert agent.registry.get_sample_value("region_agent_dns_tsig_failures_total", {"error": "badsig"}) == 1
    refused = {reason: agent.registry.get_sample_value("region_agent_dns_updates_total", {"result": reason})
               for reason in ("refused-type", "refused-name", "over-limit", "notauth", "tsig-unsigned")}
    assert refused == {"refused-type": 1, "refused-name": 2, "over-limit": 1, "notauth": 1, "tsig-unsigned": 1}


JUNK_PER_SECOND = 200
FLOOD_SECONDS = 3.0


class _Sink(asyncio.DatagramProtocol):
    """The junk sender's socket: answers to junk are counted, not read."""

    def __init__(self) -> None:
        self.answers = 0

    def datagram_received(self, data: bytes, addr: object) -> None:
        self.answers += 1


async def _flood(port: int, wires: list[bytes], *, per_second: int, seconds: float) -> int:
    """Send ``wires`` in turn, ``per_second`` a second for ``seconds`` (bounded); returns how many were sent."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(_Sink, remote_addr=("127.0.0.1", port))
    total = int(per_second * seconds)
    started = loop.time()
    try:
        for n in range(total):
            transport.sendto(wires[n % len(wires)])
            await asyncio.sleep(max(0.0, started + (n + 1) / per_second - loop.time()))  # pacing, not waiting
    finally:
        transport.close()
    return total


async def _signed_adds(port: int, count: int, spacing: float) -> list[int]:
    """``count`` validly signed adds, one every ``spacing`` seconds; their rcodes."""
    rcodes: list[int] = []
    for n in range(count):
        try:
            update = _adding(f"_acme-challenge.n{n}.{ZONE}.", value=f'"flood-{n}"')  # under the per-name limit
            response = await ask(port, _signed(update), timeout=2.0)
            rcodes.append(response.rcode())
        except dns.exception.FormError:  # an unsigned answer to a signed request (the old rate limit's REFUSED)
            rcodes.append(-1)
        await asyncio.sleep(spacing)  # pacing the client across the flood
    return rcodes


async def test_unsigned_junk_at_200_per_second_never_starves_a_signed_client(agent: Agent) -> None:
    await wait_for(agent.ready.is_set, timeout=10, message="ready")
    port = _port(agent)
    wrong = base64.b64encode(b"w" * 32).decode()
    junk = [_adding(value='"junk"').to_wire(),  # unsigned, from the same address as the signed client
            _signed(_adding(value='"junk"'), secret=wrong).to_wire()]  # our key's name, a bad MAC
    flood = asyncio.create_task(_flood(port, junk, per_second=JUNK_PER_SECOND, seconds=FLOOD_SECONDS))
    # the flood first drains the unverified budget, as in the measured incident
    await wait_for(lambda: agent.registry.get_sample_value("region_agent_dns_update_limited_total",
                                                           {"budget": "unverified"}), timeout=5,
                   message="the junk refused by its own budget")
    rcodes = await _signed_adds(port, 16, spacing=(FLOOD_SECONDS - 1.0) / 16)
    sent = await flood
    accepted = rcodes.count(dns.rcode.NOERROR)
    print(f"junk sent {sent}; signed accepted {accepted}/16; rcodes {rcodes}")
    assert accepted == 16, rcodes
    limited = {budget: agent.registry.get_sample_value("region_agent_dns_update_limited_total", {"budget": budget})
               for budget in ("unverified", "key", "source")}
    assert limited["unverified"] and limited["unverified"] > sent / 2, limited  # the junk met its own budget
    assert not limited["key"] and not limited["source"], limited


@pytest.mark.parametrize("tcp", [False, True])
async def test_a_signed_soa_query_is_answered_signed(agent: Agent, tcp: bool) -> None:
    """certbot 1.32-2.5 signs the SOA lookup that finds the zone; the answer must verify (RFC 8945 §5.3)."""
    await wait_for(agent.ready.is_set, timeout=10, message="ready")
    query = signed(dns.message.make_query(ZONE, "SOA"), TsigKey("acme-key", SECRET))
    response = await ask(_port(agent), query, tcp=tcp)  # dnspython checks the TSIG with the request's MAC
    assert response.had_tsig and response.rcode() == dns.rcode.NOERROR
    assert response.answer[0].rdtype == dns.rdatatype.SOA
