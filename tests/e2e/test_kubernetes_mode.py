"""The whole agent in Kubernetes mode against a fake API server speaking the real protocol.

This region's copy health comes from the Knative watch and goes straight into the DNS
answers and the /global-health listener; the other region's copy is HTTP-checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.exposition import generate_latest

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from region_agent.demo.fake_copy import HealthEndpoint
from region_agent.kube.resources import KNATIVE_SERVICES, PODS
from tests.conftest import wait_for
from tests.fakes.control_plane import FakeControlPlane
from tests.fakes.dns_client import ask, rdata_texts
from tests.fakes.kube_api import FakeKubeApi, write_kubeconfig
from tests.fakes.kube_objects import knative_service, pod

ZONE_FILE = """
regions:
  sfo1: {ipv4: [127.0.0.31], ns_ipv4: [127.0.0.1]}
  ams1: {ipv4: [127.0.0.32], ns_ipv4: [127.0.0.1]}
projects:
  shop: {regions: [sfo1, ams1], primary: sfo1}
"""


@pytest.fixture
async def control_plane() -> AsyncIterator[FakeControlPlane]:
    plane = FakeControlPlane()
    await plane.start()
    yield plane
    await plane.stop()


@pytest.fixture
async def world(
    tmp_path: Path, control_plane: FakeControlPlane
) -> AsyncIterator[tuple[FakeKubeApi, Agent, HealthEndpoint]]:
    api = FakeKubeApi()
    url = await api.start()
    backup = HealthEndpoint("127.0.0.32")
    await backup.start()
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE_FILE)
    settings = AgentSettings(
        region="sfo1", node="node-a", zone_file=zone, kubernetes=True,
        dns={"zone": "g.example.com", "listen_addresses": ["127.0.0.1"], "port": 0},
        checks={"host": "runr-health.g.example.com", "port": backup.port, "interval": 0.3,
                "timeout": 0.3},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0},
        kube={"config": "kubeconfig", "kubeconfig": str(write_kubeconfig(tmp_path / "kubeconfig", url)),
              "cnpg": {"enabled": False}, "node_name": "node-a"},
        usage={"spool_path": str(tmp_path / "usage.sqlite3"), "endpoint_url": control_plane.url,
               "token": control_plane.token, "token_file": None, "checkpoint_interval": 60, "report_interval": 0.2},
    )
    api.put(KNATIVE_SERVICES, knative_service("shop", slug="shop"))
    agent = Agent(settings)
    await agent.start()
    try:
        yield api, agent, backup
    finally:
        await agent.stop()
        await backup.stop()
        await api.close()


async def _answer(agent: Agent) -> set[str]:
    return rdata_texts(await ask(agent.dns.server.bound[0][1], "shop.g.example.com"))


async def _global_health(agent: Agent) -> tuple[int, str]:
    assert agent.health.listener is not None
    host, port = agent.health.listener.addresses[0]
    async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/global-health/shop") as response:
        return response.status, await response.text()


async def test_local_copy_health_drives_dns_and_the_listener(world: tuple[FakeKubeApi, Agent, HealthEndpoint]) -> None:
    api, agent, _backup = world
    await asyncio.wait_for(agent.ready.wait(), 10)
    assert await _answer(agent) == {"127.0.0.31"}
    assert await _global_health(agent) == (200, "ok")

    # The new route is not ready: this region's copy stops serving; DNS fails over at once.
    api.put(KNATIVE_SERVICES, knative_service("shop", slug="shop", ready="False", routes_ready="False",
                                              routes_reason="IngressNotConfigured", traffic=[]))
    await wait_for(lambda: _answer(agent), timeout=5, message="an answer")
    answer = await wait_for(
        lambda: _answer_if(agent, {"127.0.0.32"}), timeout=5, message="failover to ams1")
    assert answer
    status, body = await _global_health(agent)
    assert status == 503 and "route-not-ready" in body

    # Deleted: not-found here, still served from ams1.
    api.delete(KNATIVE_SERVICES, "projects", "shop")
    await wait_for(lambda: _health_if(agent, 503, "not-found"), timeout=5, message="not-found")
    assert await _answer(agent) == {"127.0.0.32"}

    # Back: the primary region answers again.
    api.put(KNATIVE_SERVICES, knative_service("shop", slug="shop"))
    assert await wait_for(lambda: _answer_if(agent, {"127.0.0.31"}), timeout=5, message="back to sfo1")


async def _answer_if(agent: Agent, expected: set[str]) -> bool:
    return await _answer(agent) == expected


async def _health_if(agent: Agent, status: int, word: str) -> bool:
    got_status, body = await _global_health(agent)
    return got_status == status and word in body


async def test_not_ready_until_the_watch_has_listed(world: tuple[FakeKubeApi, Agent, HealthEndpoint]) -> None:
    _api, agent, _backup = world
    await asyncio.wait_for(agent.ready.wait(), 10)
    assert agent.health.listener is not None
    host, port = agent.health.listener.addresses[0]
    async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/readyz") as response:
        assert response.status == 200
    async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/zone") as response:
        assert response.status == 404  # operator data is not on the public listener
    host, port = agent.health.operator.addresses[0]
    async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/zone") as response:
        zone = await response.json()
    (shop,) = [r for r in zone["records"] if r.get("type") == "project"]
    assert {t["region"]: t["health"] for t in shop["targets"]} == {"sfo1": "healthy", "ams1": "healthy"}


async def test_usage_of_a_pod_on_this_node_reaches_the_control_plane(
    world: tuple[FakeKubeApi, Agent, HealthEndpoint], control_plane: FakeControlPlane
) -> None:
    api, agent, _backup = world
    await asyncio.wait_for(agent.ready.wait(), 10)
    api.put(PODS, pod("shop-00001-deployment-abc", node="node-a"))
    api.put(PODS, pod("elsewhere", node="node-b"))  # another node's agent bills that one
    await wait_for(lambda: _metric(agent, "region_agent_usage_open_sessions") == 1, timeout=5,
                   message="one session open (the pod on node-b is not ours)")
    api.delete(PODS, "projects", "shop-00001-deployment-abc")
    records = await wait_for(lambda: list(control_plane.records.values()), timeout=10, message="a usage record")
    assert {r["pod_uid"] for r in records} == {"uid-shop-00001-deployment-abc"}
    assert all(r["region"] == "sfo1" and r["node"] == "node-a" for r in records)


def _metric(agent: Agent, name: str) -> float | None:
    for line in generate_latest(agent.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
