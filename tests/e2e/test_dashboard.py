"""Every panel of the Grafana dashboard returns data from a real Prometheus scraping real agents.

Three agent processes in a gossip cluster on loopback (one copy down, so the "regions out" panels have
something to say; DNS queries asked; one junk datagram at a gossip port, so "refused" has a reason),
and one agent in Kubernetes mode in this process, against the fake API server and control plane,
metering a pod (the usage panels). Debian's ``prometheus`` scrapes the four operator listeners every
second; each panel query (``$instance`` = all, ``$__rate_interval`` = 10s) must come back with at
least one series, and the dashboard's variable query must list the agents.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from region_agent.kube.resources import KNATIVE_SERVICES, PODS
from tests.conftest import wait_for
from tests.e2e.cluster import APEX, Cluster, three_regions
from tests.fakes.control_plane import FakeControlPlane
from tests.fakes.kube_api import FakeKubeApi, write_kubeconfig
from tests.fakes.kube_objects import knative_service, pod
from tests.fakes.ports import free_port

pytestmark = [pytest.mark.external,
              pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (Debian)")]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "region-agent.json"
TOKEN = "dashboard-test-token"


def _queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


def _expand(expr: str) -> str:
    return expr.replace("$instance", ".*").replace("$__rate_interval", "10s")


@pytest.fixture
async def usage_agent(tmp_path: Path) -> AsyncIterator[Agent]:
    """An agent in Kubernetes mode metering one pod, reporting to a fake control plane."""
    plane, api = FakeControlPlane(), FakeKubeApi()
    await plane.start()
    url = await api.start()
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
    zone = tmp_path / "k-zone.yaml"
    zone.write_text("regions:\n  sfo1: {ipv4: [127.0.0.31], ns_ipv4: [127.0.0.1]}\n"
                    "projects:\n  shop: {regions: [sfo1]}\n")
    agent = Agent(AgentSettings(
        region="sfo1", node="node-a", zone_file=zone, kubernetes=True,
        dns={"zone": APEX, "listen_addresses": ["127.0.0.1"], "port": 0},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0},
        kube={"config": "kubeconfig", "kubeconfig": str(kubeconfig), "cnpg": {"enabled": False},
              "node_name": "node-a"},
        usage={"spool_path": str(tmp_path / "usage.sqlite3"), "endpoint_url": plane.url, "token": plane.token,
               "token_file": None, "checkpoint_interval": 1, "report_interval": 0.2}))
    api.put(KNATIVE_SERVICES, knative_service("shop", slug="shop"))
    await agent.start()
    try:
        await asyncio.wait_for(agent.ready.wait(), 15)
        api.put(PODS, pod("shop-00001-deployment-abc", node="node-a"))
        yield agent
    finally:
        await agent.stop()
        await api.close()
        await plane.stop()


async def _prometheus(tmp: Path, cluster: Cluster, usage: Agent) -> tuple[subprocess.Popen[bytes], str]:
    (tmp / "token").write_text(TOKEN)
    host, port = usage.health.operator.addresses[0]
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "cluster", "authorization": {"credentials_file": str(tmp / "token")},
             "static_configs": [{"targets": [f"{a.host}:{a.operator_port}"], "labels": {"instance": a.region}}
                                for a in cluster.agents]},
            {"job_name": "kube", "static_configs": [{"targets": [f"{host}:{port}"], "labels": {"instance": "kube"}}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config))
    web = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address={web}"],
                               stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("wb"))
    return process, f"http://{web}"


async def _get(url: str) -> dict[str, Any] | None:
    try:
        async with aiohttp.ClientSession() as http, http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _ready(base: str) -> bool:
    try:
        async with aiohttp.ClientSession() as http, \
                http.get(f"{base}/-/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _series(base: str, expr: str) -> int:
    answer = await _get(f"{base}/api/v1/query?query={urllib.parse.quote(_expand(expr))}")
    return len(answer["data"]["result"]) if answer and answer.get("status") == "success" else -1


async def test_every_dashboard_panel_returns_data_from_real_agents(tmp_path: Path, usage_agent: Agent) -> None:
    cluster = await three_regions(tmp_path, token=TOKEN)
    for agent in cluster.agents:
        agent.start()
    process = None
    try:
        for agent in cluster.agents:
            await wait_for(agent.ready, timeout=40, interval=0.2, message=f"{agent.region} ready")
        cluster.copies[2].set("down")   # fra1's copy: a project with a region out
        for agent in cluster.agents:
            for _ in range(80):   # one answer in 16 is timed: the latency panel needs some
                await agent.answer(f"shop.{APEX}")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as junk:   # refused: not sealed with our key
            junk.sendto(b"\x01" * 64, (cluster.agents[0].host, cluster.agents[0].gossip_port))
        process, base = await _prometheus(tmp_path, cluster, usage_agent)
        await wait_for(lambda: _ready(base), timeout=30, interval=0.2, message="prometheus ready")
        queries = _queries()
        assert len(queries) >= 20

        async def empty() -> list[str]:
            counts = await asyncio.gather(*(_series(base, expr) for _title, expr in queries))
            return [f"{title}: {expr} ({'error' if n < 0 else 'no data'})"
                    for (title, expr), n in zip(queries, counts, strict=True) if n <= 0]

        async def all_have_data() -> bool:
            return not await empty()
        if not await wait_for_or_false(all_have_data, timeout=60):
            pytest.fail("panels without data:\n" + "\n".join(await empty()))
        agents = await _get(f"{base}/api/v1/label/instance/values?match[]=region_agent_build_info")
        assert agents is not None and set(agents["data"]) == {"sfo1", "ams1", "fra1", "kube"}
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=20)
        for agent in cluster.agents:
            agent.terminate()
        for copy in cluster.copies:
            await copy.stop()


async def wait_for_or_false(condition: Any, *, timeout: float) -> bool:
    try:
        await wait_for(condition, timeout=timeout, interval=1.0, message="every panel has data")
    except AssertionError:
        return False
    return True
