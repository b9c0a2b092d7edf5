"""Identity-bound gossip with real agents: an insider with the keyring and a CA-signed certificate that
names no agent never becomes a member; a revoked region certificate stops that region's writes; a
certificate rotated under the same CA keeps every member."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from region_agent.base.identity import full_fingerprint
from region_agent.cli.keys import issue_to_dir
from tests.conftest import wait_for
from tests.e2e.cluster import APEX, REGIONS, Agent, gather_answers, three_regions

SHOP = f"shop.{APEX}"
ALL = {"127.0.0.41", "127.0.0.42", "127.0.0.43"}


async def _members(agent: Agent) -> set[str]:
    view = await agent.region_view()
    members = None if view is None else view.get("members")
    return set(members) if isinstance(members, dict) else set()


async def _answers(agents: list[Agent], expected: set[str]) -> bool:
    return all(answer == expected for answer in await gather_answers(agents, SHOP))


async def test_an_insider_with_a_certificate_that_names_no_agent_never_joins(tmp_path: Path) -> None:
    c = await three_regions(tmp_path)
    first, ring = c.agents[0], tmp_path / "keyring.json"
    seeds = [f"{first.host}:{first.gossip_port}"]
    # The insider: the keyring, and a certificate under the cluster CA without an identity (as a stolen
    # server certificate would be), running as a lab agent that signs nothing.
    old = issue_to_dir(tmp_path / "ca", "intruder", tmp_path / "intruder", ips=["127.0.0.4"], dns=[])
    insider = c.add(3, zone_file=None, keyring=ring, seeds=seeds, extra=(
        f"  allow_unsigned: true\n  tls_ca_file: {tmp_path / 'ca' / 'ca.pem'}\n  tls_cert_file: {old[0]}\n"
        f"  tls_key_file: {old[1]}\n"))
    for agent in c.agents:
        agent.start()
    try:
        honest = c.agents[:3]
        await wait_for(lambda: _answers(honest, ALL), timeout=30, interval=0.1, message="the cluster answers")
        await wait_for(lambda: first.metric("region_agent_gossip_rejected_total", 'reason="no-identity"'),
                       timeout=20, message="the insider's streams refused")
        for _ in range(10):   # sampled over a few seconds: it never shows up anywhere
            for agent in honest:
                assert REGIONS[3] not in await _members(agent)
            await asyncio.sleep(0.3)
    finally:
        await c.stop()
    assert insider.process is not None


async def test_a_revoked_region_certificate_stops_that_regions_writes(tmp_path: Path) -> None:
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("# none yet\n")
    extra = f"  revoked_file: {revoked}\n"
    c = await three_regions(tmp_path, extra=(extra, extra, extra))
    for agent in c.agents:
        agent.start()
    try:
        await wait_for(lambda: _answers(c.agents, ALL), timeout=30, interval=0.1, message="the cluster answers")
        ams_cert = x509.load_pem_x509_certificate((tmp_path / "identity-ams1-n1" / "ams1-n1.pem").read_bytes())
        der = ams_cert.public_bytes(serialization.Encoding.DER)
        revoked.write_text(f"# ams1's agent, compromised\n{full_fingerprint(der)}\n")
        # ams1's copy health was signed by the revoked certificate: dropped, and its new reports refused.
        others = [c.agents[0], c.agents[2]]
        await wait_for(lambda: _answers(others, ALL - {"127.0.0.42"}), timeout=20, interval=0.1,
                       message="ams1's copy leaves the answers of the other regions")
        # Whatever ams1 writes now is refused: its copy stops serving, it reports that, nobody takes it.
        c.copies[1].set("down")
        await wait_for(lambda: c.agents[0].metric("region_agent_state_merge_rejected_total", 'reason="revoked"'),
                       timeout=20, message="ams1's entries refused as revoked")
        assert await _answers(others, ALL - {"127.0.0.42"})
    finally:
        await c.stop()


async def test_a_certificate_rotated_under_the_same_ca_keeps_every_member(tmp_path: Path) -> None:
    """sfo1's certificate files are replaced (as a renewed Secret would be): the agent files the new one,
    signs with it, and no member is lost at any sample meanwhile (GossipTls polls every 30 s)."""
    c = await three_regions(tmp_path)
    first = c.agents[0]
    for agent in c.agents:
        agent.start()
    try:
        await wait_for(lambda: _answers(c.agents, ALL), timeout=30, interval=0.1, message="the cluster answers")
        everyone = set(REGIONS[:3])

        async def all_members() -> bool:
            return all([await _members(agent) == everyone for agent in c.agents])

        await wait_for(all_members, timeout=20, interval=0.1, message="every agent sees every region")
        fresh = tmp_path / "renewed"
        new_cert, new_key, _ = issue_to_dir(tmp_path / "ca", "sfo1-n0", fresh, ips=[], dns=[], region="sfo1",
                                            node="n0")
        where = tmp_path / "identity-sfo1-n0"
        (where / "sfo1-n0-key.pem").write_bytes(new_key.read_bytes())
        (where / "sfo1-n0.pem").write_bytes(new_cert.read_bytes())

        async def renewed() -> bool:
            for agent in c.agents:   # sampled throughout: every member stays
                assert await _members(agent) == everyone
            return "gossip TLS certificate reloaded" in first.log.read_text()

        await wait_for(renewed, timeout=60, interval=0.5, message="the renewed certificate in use")
        c.copies[0].set("down")   # signed with the new key: taken by the others
        await wait_for(lambda: _answers(c.agents[1:], ALL - {"127.0.0.41"}), timeout=20, interval=0.1,
                       message="sfo1's report under its new certificate taken")
        for agent in c.agents:
            assert await _members(agent) == everyone
    finally:
        await c.stop()
