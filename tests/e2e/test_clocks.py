"""A skewed clock with real agents (libfaketime: the wall clock of one agent an hour fast, its monotonic
clock true): it knows it is the outlier, refuses writes instead of acknowledging ones its peers would
refuse, and the correct agents keep taking and spreading theirs."""

from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import wait_for
from tests.e2e.cluster import APEX, Agent, three_regions

FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
pytestmark = pytest.mark.external


async def _put(agent: Agent, slug: str) -> int:
    async with aiohttp.ClientSession() as session, session.put(
            f"http://{agent.host}:{agent.operator_port}/v1/projects/{slug}", json={"regions": ["sfo1", "ams1"]},
            headers={"Authorization": f"Bearer {agent.token}"}) as response:
        return response.status


async def _problems(agent: Agent) -> list[str]:
    view = await agent.region_view()
    problems = [] if view is None else view.get("agent_problems", [])
    return [str(p) for p in problems] if isinstance(problems, list) else []


@pytest.mark.skipif(not FAKETIME.exists() or shutil.which("faketime") is None, reason="needs libfaketime")
async def test_an_agent_an_hour_fast_refuses_writes_and_the_others_keep_theirs(tmp_path: Path) -> None:
    c = await three_regions(tmp_path, token="clock-token")
    first, fast = c.agents[0], c.agents[2]
    fast.env = {"LD_PRELOAD": str(FAKETIME), "FAKETIME": "+3600s", "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                "FAKETIME_NO_CACHE": "1"}
    for agent in c.agents:
        agent.start()
    try:
        await wait_for(lambda: _answer_everywhere(c.agents[:2]), timeout=30, interval=0.1,
                       message="the correct agents answer")
        await wait_for(lambda: fast.metric("region_agent_clock_outlier"), timeout=30, interval=0.2,
                       message="the fast agent knows it is the outlier")
        problems = await wait_for(lambda: _clock_problems(fast), timeout=10, interval=0.2,
                                  message="the reason shown")
        assert any("ahead of the median" in p or "HLC" in p for p in problems), problems
        assert await _put(fast, "blog") == 503   # nothing acknowledged that the peers would refuse
        for agent in c.agents[:2]:
            assert await agent.metric("region_agent_clock_outlier") == 0   # one fast peer is not their problem
        assert await _put(first, "docs") in (200, 201)
        await wait_for(lambda: c.agents[1].answer(f"docs.{APEX}"), timeout=15, interval=0.1,
                       message="a correct agent's write spreads to the other correct agent")
        # What the fast agent wrote (its copy health, stamped an hour ahead) is refused as clock drift.
        await wait_for(lambda: first.metric("region_agent_state_merge_rejected_total", 'reason="clock-drift"'),
                       timeout=20, interval=0.2, message="the fast agent's entries refused")
    finally:
        await c.stop()


async def _clock_problems(agent: Agent) -> list[str]:
    return [p for p in await _problems(agent) if p.startswith("clock:")]


async def _answer_everywhere(agents: list[Agent]) -> bool:
    return all([bool(await agent.answer(f"shop.{APEX}")) for agent in agents])
