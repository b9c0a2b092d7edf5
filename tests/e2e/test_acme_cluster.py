"""ACME DNS-01 across a cluster (issue 11): an UPDATE accepted by one agent is answered by every agent.

Three real agents on 127.0.0.1-3 joined by encrypted gossip, every one with the same TSIG key
(HMAC-MD5, cert-manager's default). cert-manager sends the UPDATE to one name server and then
polls every name server of the zone for the TXT value before it asks the CA to validate, so the
value must reach every agent; its cleanup (delete-RR, class NONE) must leave every agent too.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import dns.message
import dns.rcode
import dns.tsig
import dns.update
import pytest

from region_agent.gossip.keyring import generate_key
from tests.conftest import wait_for
from tests.e2e.cluster import APEX, Agent, gather_answers
from tests.e2e.fleet import Fleet, Tsig, copy_address
from tests.fakes.dns_client import TsigKey, ask, signed, try_ask, txt_update, txt_values

KEY = Tsig("cert-manager", "hmac-md5", base64.b64encode(b"cluster-acme-secret-0123456789ab").decode())
CM_KEY = TsigKey(KEY.name, KEY.secret, dns.tsig.HMAC_MD5)  # the same key, as dnspython names the algorithm
CHALLENGE = f"_acme-challenge.{APEX}."
MIXED_CASE = "_ACME-Challenge.G.Example.COM."   # what a resolver using 0x20 might send
ALL = {copy_address(0), copy_address(1), copy_address(2)}


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    c = Fleet(tmp_path)
    try:
        await c.build(3, key=generate_key(), tsig=KEY)
        for agent in c.agents:
            agent.start()
        await wait_for(lambda: _everywhere(c.agents, f"shop.{APEX}", ALL), timeout=30, interval=0.1,
                       message="every agent answers every region's copy")
        yield c
    finally:
        await c.stop()


async def _everywhere(agents: list[Agent], name: str, expected: set[str]) -> bool:
    return all(answer == expected for answer in await gather_answers(agents, name))


async def _txt(agent: Agent, name: str = CHALLENGE) -> dns.message.Message | None:
    return await try_ask(agent.dns_port, name, "TXT", host=agent.host, timeout=1)


def _values(response: dns.message.Message | None) -> set[str] | None:
    return None if response is None else txt_values(response)


async def _all_answer(agents: list[Agent], values: set[str]) -> bool:
    responses = await asyncio.gather(*(_txt(a) for a in agents))
    return all(_values(r) == values for r in responses)


async def _gone_everywhere(agents: list[Agent]) -> bool:
    responses = await asyncio.gather(*(_txt(a) for a in agents))
    return all(r is not None and r.rcode() == dns.rcode.NXDOMAIN and not r.answer for r in responses)


def _cert_manager(action: Literal["add", "delete"], value: str) -> dns.update.UpdateMessage:
    """As cert-manager's RFC 2136 solver builds it (PLATFORM.md §4.1): add with TTL 60, delete-RR with
    class NONE, HMAC-MD5, fudge 300."""
    return signed(txt_update(APEX, CHALLENGE, action, value), CM_KEY, fudge=300)


async def _send(agent: Agent, update: dns.update.UpdateMessage) -> None:
    response = await ask(agent.dns_port, update, host=agent.host)
    assert response.rcode() == dns.rcode.NOERROR and response.had_tsig, response


async def _run(*argv: str, stdin: str = "") -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(stdin.encode()), 20)
    return process.returncode or 0, out.decode()


@pytest.mark.external
@pytest.mark.skipif(shutil.which("nsupdate") is None or shutil.which("dig") is None,
                    reason="nsupdate and dig come with Debian's bind9-dnsutils (scripts/system-packages.sh)")
async def test_nsupdate_at_one_agent_is_answered_by_dig_at_every_agent_and_a_cert_manager_delete_clears_all(
        fleet: Fleet) -> None:
    agents = fleet.agents
    first = agents[0]
    script = (f"server {first.host} {first.dns_port}\nzone {APEX}\n"
              f'update add {CHALLENGE} 60 TXT "token-from-nsupdate"\nsend\n')
    code, out = await _run("nsupdate", "-y", f"hmac-md5:{KEY.name}:{KEY.secret}", stdin=script)
    assert code == 0, out
    await wait_for(lambda: _all_answer(agents, {"token-from-nsupdate"}), timeout=10, interval=0.02,
                   message="the challenge answered by every agent")

    for agent in agents:   # as an operator checks it: dig at each name server, in the case it was asked
        code, out = await _run("dig", f"@{agent.host}", "-p", str(agent.dns_port), "+noall", "+answer",
                               "TXT", MIXED_CASE)
        assert code == 0, out
        owner, ttl, klass, rdtype, value = out.split()
        assert (owner, klass, rdtype, value) == (MIXED_CASE, "IN", "TXT", '"token-from-nsupdate"'), out
        assert 0 < int(ttl) <= 60, out

    # cert-manager's cleanup, sent to another agent than the one that took the add
    await _send(agents[1], _cert_manager("delete", "token-from-nsupdate"))
    await wait_for(lambda: _gone_everywhere(agents), timeout=10, interval=0.02,
                   message="the challenge gone at every agent")
    for agent in agents:
        code, out = await _run("dig", f"@{agent.host}", "-p", str(agent.dns_port), "+short", "TXT", CHALLENGE)
        assert (code, out.strip()) == (0, ""), out


async def test_cert_manager_present_and_cleanup_through_different_agents(fleet: Fleet) -> None:
    agents = fleet.agents
    # present at the last agent: both values of a wildcard + apex order (two challenges at one name)
    await _send(agents[2], _cert_manager("add", "apex-token"))
    await _send(agents[2], _cert_manager("add", "wildcard-token"))
    await wait_for(lambda: _all_answer(agents, {"apex-token", "wildcard-token"}), timeout=10, interval=0.02,
                   message="both values answered by every agent")
    for agent in agents:   # TTL as sent, the query's case in the answer
        response = await _txt(agent, MIXED_CASE)
        assert response is not None and response.rcode() == dns.rcode.NOERROR
        (rrset,) = response.answer
        assert rrset.name.to_text() == MIXED_CASE and rrset.ttl == 60, rrset

    # cleanup of one value at the first agent leaves the other everywhere, then the last one goes
    await _send(agents[0], _cert_manager("delete", "apex-token"))
    await wait_for(lambda: _all_answer(agents, {"wildcard-token"}), timeout=10, interval=0.02,
                   message="only the other value left at every agent")
    await _send(agents[1], _cert_manager("delete", "wildcard-token"))
    await wait_for(lambda: _gone_everywhere(agents), timeout=10, interval=0.02,
                   message="no challenge left at any agent")
    await wait_for(lambda: _one_serial(agents), timeout=10, message="one SOA serial everywhere")


async def _one_serial(agents: list[Agent]) -> bool:
    serials = await asyncio.gather(*(a.serial() for a in agents))
    return serials[0] is not None and len(set(serials)) == 1
