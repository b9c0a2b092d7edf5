"""An agent that can not reach its cluster, or restarts without its snapshot, never answers an empty zone.

- An island (its certificate from another CA: every handshake fails) with an empty store: not ready,
  SERVFAIL (never NXDOMAIN) for a live name, control-API writes refused, the reason shown.
- An agent restarted 20 times without a snapshot (kill -9), sampled every 50 ms from the first answer:
  never NXDOMAIN for a live name.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import dns.rcode

from region_agent.cli.keys import init_dir
from tests.conftest import wait_for
from tests.e2e.cluster import APEX, REGIONS, Agent, Cluster, identity_yaml, three_regions

SHOP = f"shop.{APEX}"
RESTARTS = 20
ALL = {"127.0.0.41", "127.0.0.42", "127.0.0.43"}


async def _rcode(agent: Agent, name: str) -> int | None:
    response = await agent.query(name)
    return None if response is None else response.rcode()


async def _put_project(agent: Agent, slug: str) -> int:
    async with aiohttp.ClientSession() as session, session.put(
            f"http://{agent.host}:{agent.operator_port}/v1/projects/{slug}", json={"regions": ["sfo1"]},
            headers={"Authorization": f"Bearer {agent.token}"}) as response:
        return response.status


async def _cluster(tmp_path: Path, *, island_ca: bool) -> Cluster:
    extra = ""
    if island_ca:   # fra1's certificate from another CA: every handshake with the others fails
        init_dir(tmp_path / "other-ca")
        extra = identity_yaml(tmp_path, REGIONS[2], "n2", ca="other-ca")
    return await three_regions(tmp_path, token="s3cret-token", extra=("", "", extra))


async def test_an_island_is_not_ready_withholds_its_empty_zone_and_refuses_writes(tmp_path: Path) -> None:
    c = await _cluster(tmp_path, island_ca=True)
    for agent in c.agents:
        agent.start()
    island = c.agents[2]
    try:
        await wait_for(lambda: c.agents[1].answer(SHOP), timeout=30, interval=0.1, message="the cluster answers")
        await wait_for(lambda: _rcode(island, SHOP), timeout=30, interval=0.1, message="the island answers DNS")
        deadline = time.monotonic() + 12   # past ready_sync_timeout (3 s): the island stays an island
        while time.monotonic() < deadline:
            assert await _rcode(island, SHOP) == dns.rcode.SERVFAIL   # never NXDOMAIN for a live name
            assert not await island.ready()
            await asyncio.sleep(0.25)
        assert await _put_project(island, "blog") == 503
        view = await island.region_view()
        problems = [] if view is None else view.get("agent_problems", [])
        assert isinstance(problems, list) and any("island" in p for p in problems), problems
        assert await _put_project(c.agents[1], "blog") in (200, 201)   # the cluster itself takes writes
    finally:
        await c.stop()


async def test_a_restart_without_a_snapshot_never_answers_nxdomain_for_a_live_name(tmp_path: Path) -> None:
    c = await _cluster(tmp_path, island_ca=False)
    for agent in c.agents:
        agent.start()
    restarted = c.agents[2]
    try:
        await wait_for(lambda: restarted.answer(SHOP), timeout=30, interval=0.1, message="the cluster answers")
        for _ in range(RESTARTS):
            restarted.kill()
            restarted.start()
            answered = False
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not answered:
                rcode = await _rcode(restarted, SHOP)
                assert rcode != dns.rcode.NXDOMAIN, "an empty store answered NXDOMAIN for a live name"
                answered = rcode == dns.rcode.NOERROR and bool(await restarted.answer(SHOP))
                await asyncio.sleep(0.05)
            assert answered, "the restarted agent never answered"
    finally:
        await c.stop()


async def test_an_agent_configured_for_another_zone_is_refused_on_both_sides(tmp_path: Path) -> None:
    c = await _cluster(tmp_path, island_ca=False)
    odd = c.agents[2]
    odd.config.write_text(odd.config.read_text().replace(f"zone: {APEX}", "zone: other.example.net", 1))
    for agent in c.agents:
        agent.start()
    try:
        await wait_for(lambda: c.agents[1].answer(SHOP), timeout=30, interval=0.1, message="the cluster answers")
        await wait_for(lambda: c.agents[0].metric("region_agent_gossip_rejected_total", 'reason="zone-mismatch"'),
                       timeout=20, message="the other zone's agent refused")
        await wait_for(lambda: odd.metric("region_agent_gossip_rejected_total", 'reason="zone-mismatch"'),
                       timeout=20, message="and it refuses them")
        for agent in c.agents[:2]:
            view = await agent.region_view()
            members = {} if view is None else view.get("members") or {}
            assert isinstance(members, dict) and REGIONS[2] not in members, members
        assert "serves zone other.example.net" in c.agents[0].log.read_text()
    finally:
        await c.stop()


async def test_a_region_back_in_gossip_is_answered_from_reports_made_after_its_return(tmp_path: Path) -> None:
    """fra1's only agent is killed; while it is away its copy breaks. Its old report said healthy: when
    it comes back, fra1 stays out of the answers until it has reported again, and then its copy is down.
    Sampled every 50 ms at sfo1: fra1's address never answers after the restart."""
    c = await _cluster(tmp_path, island_ca=False)
    for agent in c.agents:
        agent.start()
    sfo1, fra1 = c.agents[0], c.agents[2]
    try:
        await wait_for(lambda: _answers_at(sfo1, ALL), timeout=30, interval=0.1, message="every copy answered")
        fra1.kill()
        await wait_for(lambda: _answers_at(sfo1, ALL - {"127.0.0.43"}), timeout=30, interval=0.1,
                       message="fra1 out while its agent is away")
        c.copies[2].set("down")   # broken while nobody in fra1 can say so
        fra1.start()
        deadline = time.monotonic() + 30
        while not await fra1.ready():   # sampled throughout its return
            assert time.monotonic() < deadline, "fra1's agent never became ready"
            await _never_fra1(sfo1)
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 3   # and afterwards too: its fresh report says down
        while time.monotonic() < deadline:
            await _never_fra1(sfo1)
            await asyncio.sleep(0.05)
    finally:
        await c.stop()


async def _answers_at(agent: Agent, expected: set[str]) -> bool:
    return await agent.answer(SHOP) == expected


async def _never_fra1(agent: Agent) -> None:
    answer = await agent.answer(SHOP)
    if answer is not None and "127.0.0.43" in answer:
        view = await agent.region_view()
        raise AssertionError(f"fra1 answered: {answer}; verdicts {None if view is None else view.get('cluster')}")
