"""An agent away longer than the tombstone horizon: not ready, SERVFAIL, writes refused until it has pulled
the peers' state (the pull itself: tests/gossip/test_sync.py). A real agent process in a one-agent cluster."""

from __future__ import annotations

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
