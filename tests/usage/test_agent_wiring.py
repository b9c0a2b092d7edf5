"""Usage as the agent wires it (``Agent._start_usage`` → ``build_usage``): its status reaches the supervisor.

The volume is misconfigured the way a hostPath of type File would be: the spool's directory is a
regular file, which stops root as well. The agent keeps running, says why usage is unavailable, and
picks the spool up once the directory exists, without a restart.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from region_agent.kube.resources import PODS
from tests.conftest import wait_for
from tests.fakes.control_plane import FakeControlPlane
from tests.fakes.kube_api import FakeKubeApi
from tests.usage.factory import down, up


@pytest.fixture
async def servers() -> AsyncIterator[tuple[FakeKubeApi, FakeControlPlane]]:
    fake = FakeKubeApi()
    await fake.start()
    plane = FakeControlPlane()
    await plane.start()
    yield fake, plane
    await plane.stop()
    await fake.close()


def _metric(agent: Agent, name: str, **labels: str) -> float | None:
    return agent.registry.get_sample_value(name, labels)


async def test_agent_reports_usage_unavailable_until_the_spool_volume_is_fixed(
    tmp_path: Path, servers: tuple[FakeKubeApi, FakeControlPlane]
) -> None:
    fake, plane = servers
    volume = tmp_path / "volume"
    volume.write_text("a file where the spool directory should be\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
        "users": [{"name": "agent", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}]}))
    settings = AgentSettings(
        region="sfo1", node="node-a", kubernetes=True,
        dns={"zone": "g.example.com", "listen_addresses": ["127.0.0.1"], "port": 0},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0},
        kube={"config": "kubeconfig", "kubeconfig": str(kubeconfig), "cnpg": {"enabled": False},
              "node_name": "node-a"},
        usage={"spool_path": str(volume / "usage.sqlite3"), "endpoint_url": plane.url, "token": plane.token,
               "token_file": None, "report_interval": 0.1, "commit_delay": 0.0, "spool_retry_initial": 0.05,
               "spool_retry_cap": 0.2},
    )
    agent = Agent(settings)
    await agent.start()
    usage = agent.usage
    assert usage is not None
    try:
        await wait_for(lambda: (usage.status.code == "spool-unavailable"
                                and (_metric(agent, "region_agent_usage_spool_open_errors_total",
                                             kind="unavailable") or 0) >= 2),
                       timeout=10, message="usage unavailable")
        assert usage.status.state == "unavailable" and "can not create directory" in usage.status.reason
        assert any(p.startswith("usage unavailable (spool-unavailable)") for p in agent.problems())
        assert _metric(agent, "region_agent_usage_spool_available") == 0
        start = int(time.time()) - 100  # a pod that ran 42 s while the spool was unavailable
        fake.put(PODS, up(start, name="a", uid="a", node="node-a"))
        fake.put(PODS, down(start + 42, name="a", uid="a", node="node-a"))
        await wait_for(lambda: usage.journal_events >= 2, timeout=10, message="events journaled")
        assert plane.requests == 0

        volume.unlink()
        volume.mkdir()  # the operator fixes the mount: no restart
        await wait_for(lambda: usage.problems() == (), timeout=10, message="usage available")
        assert not any(p.startswith("usage") for p in agent.problems())
        await wait_for(lambda: plane.seconds_by_pod() == {"a": 42}, timeout=10, message="a billed from the journal")
        assert _metric(agent, "region_agent_usage_spool_available") == 1
    finally:
        await agent.stop()
