"""An agent away longer than the tombstone horizon: not ready, SERVFAIL, writes refused until it has pulled
the peers' state (the pull itself: tests/gossip/test_sync.py). A real agent process in a one-agent cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import aiohttp
import dns.asyncquery
import dns.message
import dns.rcode

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from region_agent.gossip.keyring import generate_key
from region_agent.gossip.messages import Address
from tests.conftest import wait_for
from tests.e2e.cluster import write_keyring
from tests.fakes.ports import free_port

ZONE = "regions: {sfo1: {ipv4: [127.0.0.51]}}\nprojects: {shop: {regions: [sfo1]}}\n"


async def _rcode(agent: Agent) -> int:
    response = await dns.asyncquery.udp(dns.message.make_query("shop.g.example.com", "A"), "127.0.0.1",
                                        port=agent.dns.server.bound[0][1], timeout=2)
    return response.rcode()


async def _readyz(agent: Agent) -> int:
    assert agent.health.listener is not None
    url = "http://{}:{}/readyz".format(*agent.health.listener.addresses[0])
    async with aiohttp.ClientSession() as http, http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
        return r.status


async def test_an_agent_away_beyond_the_horizon_answers_nothing_and_takes_no_write_until_it_pulled(
        tmp_path: Path) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE)
    key = generate_key()
    write_keyring(tmp_path / "keyring.json", [key], key)
    agent = Agent(AgentSettings(
        region="sfo1", zone_file=zone, dns={"listen_addresses": ["127.0.0.1"], "port": 0},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0},
        gossip={"enabled": True, "bind_address": "127.0.0.1", "port": free_port(), "preset": "lan",
                "keyring_file": str(tmp_path / "keyring.json"), "allow_unsigned": True, "ready_sync_timeout": 0.5}))
    await agent.start()
    try:
        await wait_for(agent.ready.is_set, timeout=15, message="ready")
        cluster = agent.cluster
        assert cluster is not None
        assert await _rcode(agent) == dns.rcode.NOERROR and agent.has_majority()
        limit = cluster.anti_entropy.absent_limit
        assert limit is not None and 28 * 86_400 < limit < 30 * 86_400   # the control tombstones' 30 days, less a day
        # A peer to pull from (the gossip of a one-agent cluster has none: alone with a majority it stays fresh).
        cluster.anti_entropy._peers = lambda: [Address("127.0.0.9", 7946)]
        cluster.anti_entropy.last_fresh = time.monotonic() - limit - 1
        cluster.anti_entropy._check_absence()   # the sync loop's check, now rather than at its next tick
        assert cluster.rejoining()
        assert await _rcode(agent) == dns.rcode.SERVFAIL
        assert not agent.has_majority() and "pull-only" in (cluster.writable() or "")
        assert any("rejoining pull-only" in p for p in agent.problems())

        async def not_ready() -> bool:
            return await _readyz(agent) == 503
        await wait_for(not_ready, timeout=5, message="/readyz 503")
        cluster.anti_entropy._rejoined(0)   # the pull completed (no peer here to pull from)
        assert await _rcode(agent) == dns.rcode.NOERROR and agent.has_majority()
        assert not any("pull-only" in p for p in agent.problems())
    finally:
        await agent.stop()


TWO_REGIONS = ("regions: {sfo1: {ipv4: [127.0.0.51]}, ams1: {ipv4: [127.0.0.52]}}\n"
               "projects: {shop: {regions: [sfo1, ams1]}}\n")


def _settings(tmp_path: Path, port: int) -> AgentSettings:
    return AgentSettings(
        region="sfo1", zone_file=tmp_path / "zone.yaml", state_file=tmp_path / "state.jsonl",
        dns={"listen_addresses": ["127.0.0.1"], "port": 0},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0},
        gossip={"enabled": True, "bind_address": "127.0.0.1", "port": port, "preset": "lan",
                "keyring_file": str(tmp_path / "keyring.json"), "allow_unsigned": True, "ready_sync_timeout": 0.5})


def _header(path: Path) -> dict[str, object]:
    header = json.loads(path.read_bytes().split(b"\n", 1)[0])
    assert isinstance(header, dict)
    return header


async def test_the_absence_clock_survives_a_restart_from_the_snapshot(tmp_path: Path) -> None:
    """An agent cut off for 40 days (it kept running and saving its snapshot, so the snapshot is recent) is
    restarted: it rejoins pull-only from its start, as it would have without the restart. Before the last
    fresh round was kept in the snapshot, a restart made it fresh, ready to offer month-old entries whose
    deletes every peer has forgotten. Two regions, the other one gone: alone it sees no majority, so nothing
    makes it fresh here (a one-region agent alone is the cluster, and fresh)."""
    (tmp_path / "zone.yaml").write_text(TWO_REGIONS)
    key = generate_key()
    write_keyring(tmp_path / "keyring.json", [key], key)
    port = free_port()
    forty_days = 40 * 86_400
    first = Agent(_settings(tmp_path, port))
    await first.start()
    try:
        await wait_for(lambda: {"sfo1", "ams1"} <= first.store.regions.keys(), timeout=15, message="zone imported")
        cluster = first.cluster
        assert cluster is not None and not cluster.rejoining()
        # Its last fresh round was 40 days ago (the sync loop's check would turn it pull-only only with a peer
        # in sight; none here): that is what the snapshot it writes at stop must say.
        cluster.anti_entropy.last_fresh = time.monotonic() - forty_days
    finally:
        await first.stop()
    header = _header(tmp_path / "state.jsonl")
    saved_at, last_fresh = header["saved_at"], header.get("last_fresh")
    assert isinstance(saved_at, float) and time.time() - saved_at < 60, "a recent snapshot: not moved aside"

    second = Agent(_settings(tmp_path, port))
    await second.start()
    try:
        cluster = second.cluster
        assert cluster is not None
        assert len(second.store.projects) == 1, "the snapshot was loaded"
        assert cluster.rejoining(), "pull-only from the start: the restart did not reset the absence clock"
        assert isinstance(last_fresh, float) and abs(time.time() - forty_days - last_fresh) < 60
        assert time.monotonic() - cluster.anti_entropy.last_fresh > forty_days - 60
        assert await _rcode(second) == dns.rcode.SERVFAIL
        assert "pull-only" in (cluster.writable() or "")
        assert any("rejoining pull-only" in p for p in second.problems())

        async def not_ready() -> bool:
            return await _readyz(second) == 503
        await wait_for(not_ready, timeout=5, message="/readyz 503")
    finally:
        await second.stop()
    # Still not fresh: the snapshot written at this stop keeps the old round, it does not restart the clock.
    kept = _header(tmp_path / "state.jsonl").get("last_fresh")
    assert isinstance(kept, float) and abs(kept - last_fresh) < 60
