"""The cluster alerts fire on what real agents export: recorded during a kill -9 and an isolation.

Three regions in network namespaces (the partition harness of ``test_partitions``), every agent's
operator ``/metrics`` scraped once a second (:mod:`tests.e2e.alert_recording`): a quiet stretch, then
the fault, then long enough for the rules' ``for:`` at the recording's 15x time scale. The recording
becomes a promtool test with the alerts expected just before the fault (none) and at the end, and
promtool runs it against deploy/prometheus/alerts.yaml. ``REGION_AGENT_RECORD=1`` also writes it to
deploy/prometheus/recorded_test.yaml, the checked-in copy tests/deploy/test_alerts.py runs on every
test run (so the rules are always tested on real series, and re-recording shows they still are).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.alert_recording import RULES, Expect, Recording, Scrape, promtool_test, record, write_tests
from tests.e2e.netns import unavailable
from tests.e2e.test_partitions import NsAgent, partitioned

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
    pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian: prometheus)"),
]

REGIONS = ("sfo1", "ams1", "fra1")
QUIET_S, FAULT_S = 8, 36
CLUSTER_ALERTS = ("RegionAgentRegionOutOfAnswers", "RegionAgentNoMajority", "RegionAgentRegionWithoutAgents",
                  "RegionAgentMemberDied")


def _scrapes(agents: dict[str, NsAgent]) -> dict[str, Scrape]:
    def scrape(agent: NsAgent) -> Scrape:
        async def get() -> str:
            status, body = await agent.get("/metrics", operator=True)
            return body if status == 200 else ""
        return get
    return {region: scrape(agent) for region, agent in agents.items()}


def _quiet(at: int) -> list[Expect]:
    return [Expect(alert, at) for alert in CLUSTER_ALERTS]


def _promtool(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120,
                          check=False, cwd=path.parent)


async def _kill_9(tmp: Path) -> dict[str, Any]:
    async with partitioned(tmp, REGIONS) as setup:
        recording = Recording()
        await record(recording, _scrapes(setup.agents), QUIET_S)
        recording.mark("kill")
        setup.agents["fra1"].kill()
        await record(recording, _scrapes(setup.agents), FAULT_S)
    end = recording.ticks - 1
    return promtool_test("kill -9 of fra1's only agent (recorded)", recording, [
        *_quiet(recording.events["kill"] - 1),
        Expect("RegionAgentRegionOutOfAnswers", end, ({"region": "fra1"},)),
        Expect("RegionAgentRegionWithoutAgents", end, ({"region": "fra1"},)),
        Expect("RegionAgentMemberDied", end, ({},)),
        Expect("RegionAgentNoMajority", end),   # two of three regions: a majority everywhere
    ])


async def _isolation(tmp: Path) -> dict[str, Any]:
    async with partitioned(tmp, REGIONS) as setup:
        recording = Recording()
        await record(recording, _scrapes(setup.agents), QUIET_S)
        recording.mark("isolate")
        setup.net.isolate("fra1")
        await record(recording, _scrapes(setup.agents), FAULT_S)
        setup.net.heal_all()
    end = recording.ticks - 1
    return promtool_test("fra1 isolated (recorded)", recording, [
        *_quiet(recording.events["isolate"] - 1),
        Expect("RegionAgentRegionOutOfAnswers", end, ({"region": "fra1"},)),
        # fra1 sees no member of the others, but it has no majority: only the majority's view counts
        Expect("RegionAgentRegionWithoutAgents", end, ({"region": "fra1"},)),
        Expect("RegionAgentNoMajority", end, ({"instance": "fra1"},)),
        Expect("RegionAgentMemberDied", end, ({},)),
    ])


async def test_cluster_alerts_fire_on_series_recorded_from_real_agents(tmp_path: Path) -> None:
    for scenario in ("kill", "isolation"):
        (tmp_path / scenario).mkdir()
    tests = [await _kill_9(tmp_path / "kill"), await _isolation(tmp_path / "isolation")]
    fresh = tmp_path / "recorded_test.yaml"
    write_tests(fresh, tests)
    result = _promtool(fresh)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    if os.environ.get("REGION_AGENT_RECORD") == "1":
        write_tests(RULES / "recorded_test.yaml", tests)
