"""A failing part of the agent makes it degraded, visibly, while DNS keeps answering."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import dns.asyncquery
import dns.message
import dns.rcode

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from tests.conftest import wait_for

ZONE = "regions: {sfo1: {ipv4: [127.0.0.51]}}\nprojects: {shop: {regions: [sfo1]}}\n"


async def _get(url: str) -> tuple[int, dict[str, str], str]:
    async with aiohttp.ClientSession() as http, http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
        return r.status, dict(r.headers), await r.text()


async def test_a_failing_task_is_restarted_and_shown_until_it_runs_again(tmp_path: Path) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE)
    agent = Agent(AgentSettings(region="sfo1", zone_file=zone,
                                dns={"listen_addresses": ["127.0.0.1"], "port": 0},
                                health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    failures = 0
    original = agent.zone_file.run if agent.zone_file is not None else None
    assert original is not None

    async def breaks_twice() -> None:
        nonlocal failures
        if failures < 2:
            failures += 1
            raise OSError(5, "Input/output error")
        await original()

    agent.zone_file.run = breaks_twice  # type: ignore[union-attr,method-assign]
    await agent.start()
    try:
        public = agent.health.listener
        assert public is not None
        public_url = "http://{}:{}".format(*public.addresses[0])
        operator_url = "http://{}:{}".format(*agent.health.operator.addresses[0])
        await wait_for(lambda: failures == 2 and agent.problems(), timeout=10, message="two failures seen")
        problem = agent.problems()[0]
        assert problem.startswith("task zone file watcher") and "OSError" in problem
        assert agent.registry.get_sample_value("region_agent_degraded") == 1
        assert (agent.registry.get_sample_value("region_agent_degraded_sources", {"source": "task_supervisor"})
                or 0) >= 1
        assert agent.registry.get_sample_value("region_agent_degraded_sources", {"source": "checker"}) == 0
        assert agent.registry.get_sample_value("region_agent_build_info", {
            "version": "0.1.0", "zone": "g.example.com", "region": "sfo1", "role": "agent"}) == 1

        async def shown() -> bool:
            _status, headers, body = await _get(public_url + "/health/region")
            return headers.get("X-Degraded") == "true" and "agent-degraded" in body
        await wait_for(shown, timeout=5, message="public /health/region degraded")
        _status, _headers, body = await _get(public_url + "/health/region")
        assert "Input/output error" not in body  # reason codes only in public
        _status, _headers, body = await _get(operator_url + "/health/region")
        assert "Input/output error" in body
        await wait_for(agent.ready.is_set, timeout=10, message="ready")
        status, headers, body = await _get(public_url + "/readyz")
        assert (status, headers.get("X-Degraded"), body) == (200, "true", "ready, degraded: agent-degraded")
        response = await dns.asyncquery.udp(dns.message.make_query("shop.g.example.com", "A"), "127.0.0.1",
                                            port=agent.dns.server.bound[0][1], timeout=2)
        assert response.rcode() == dns.rcode.NOERROR  # DNS answers throughout
        assert agent.registry.get_sample_value("region_agent_task_restarts_total",
                                               {"task": "zone file watcher"}) == 2
    finally:
        await agent.stop()


async def test_problems_clear_when_the_task_stays_up(tmp_path: Path) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE)
    agent = Agent(AgentSettings(region="sfo1", zone_file=zone,
                                dns={"listen_addresses": ["127.0.0.1"], "port": 0},
                                health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    agent.tasks.stable_after = 0.2
    ran = asyncio.Event()

    async def once_broken() -> None:
        if not ran.is_set():
            ran.set()
            raise RuntimeError("first start fails")
        await asyncio.Event().wait()

    await agent.start()
    try:
        agent.tasks.spawn("flaky part", once_broken)
        await wait_for(agent.problems, timeout=5, message="degraded")
        await wait_for(lambda: agent.problems() == (), timeout=10, message="healthy again")
        def republished() -> bool:
            view = agent.health.holder.get()
            return view is not None and view.degraded == ()
        await wait_for(republished, timeout=5, message="view republished without problems")
    finally:
        await agent.stop()
