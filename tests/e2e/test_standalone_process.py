"""``region-agent run`` as a real process: start-up, answers, reloads, CLI, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from region_agent.demo.fake_copy import HealthEndpoint
from tests.conftest import wait_for
from tests.fakes.dns_client import answers
from tests.fakes.ports import free_port

ZONE = """
regions:
  sfo1: {ipv4: [127.0.0.41], ns_ipv4: [127.0.0.1]}
  ams1: {ipv4: [127.0.0.42], ns_ipv4: [127.0.0.1]}
projects:
  shop: {regions: [sfo1, ams1], primary: sfo1}
"""



@dataclass
class Running:
    process: subprocess.Popen[bytes]
    dns_port: int
    http_port: int
    zone: Path
    copies: dict[str, HealthEndpoint]
    log: Path
    operator_port: int = 0  # /metrics, /zone: the operator listener


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Running]:
    copies = {"sfo1": HealthEndpoint("127.0.0.41"), "ams1": HealthEndpoint("127.0.0.42")}
    check_port = await copies["sfo1"].start()
    copies["ams1"].port = check_port
    await copies["ams1"].start()
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE)
    dns_port, http_port = free_port(), free_port()
    operator_port = free_port()
    config = tmp_path / "agent.yaml"
    config.write_text(f"""
region: sfo1
zone_file: zone.yaml
zone_file_poll_interval: 0.2
dns: {{zone: g.example.com, listen_addresses: [127.0.0.1], port: {dns_port}}}
checks: {{host: runr-health.g.example.com, port: {check_port}, interval: 0.5, timeout: 0.4}}
health: {{listen_addresses: [127.0.0.1], port: {http_port}, operator_port: {operator_port}}}
""")
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "region_agent", "run", "--config", str(config)], stdout=out,
                                   stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    try:
        yield Running(process, dns_port, http_port, zone, copies, log, operator_port)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        for copy in copies.values():
            await copy.stop()


async def _answer(agent: Running, name: str = "shop.g.example.com") -> set[str] | None:
    return await answers(agent.dns_port, name, timeout=0.5)


async def _get(agent: Running, path: str) -> tuple[int, str]:
    # /metrics and /zone are the operator listener's; the public port answers them 404.
    port = agent.operator_port if path in ("/metrics", "/zone") else agent.http_port
    try:
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status, await r.text()
    except aiohttp.ClientError:
        return 0, ""


async def _ready(agent: Running) -> bool:
    return (await _get(agent, "/readyz"))[0] == 200


async def test_serves_fails_over_reloads_and_stops(agent: Running) -> None:
    await wait_for(lambda: _ready(agent), timeout=15, message="/readyz")
    assert await _answer(agent) == {"127.0.0.41"}

    agent.copies["sfo1"].set("down")
    assert await wait_for(lambda: _answer_is(agent, {"127.0.0.42"}), timeout=5, message="failover")

    # A bad zone file is refused whole; the zone stays; the error is counted.
    agent.zone.write_text("projects: {shop: {regions: [nowhere]}}\n")
    agent.process.send_signal(signal.SIGHUP)
    await wait_for(lambda: _metric_at_least(agent, "region_agent_zone_file_errors_total", 1), timeout=5,
                   message="error counted")
    assert await _answer(agent) == {"127.0.0.42"}

    # A good file adds a project; it is checked and answered without a restart.
    agent.zone.write_text(ZONE + "  blog: {regions: [ams1]}\n")
    assert await wait_for(lambda: _answer_is(agent, {"127.0.0.42"}, "blog.g.example.com"), timeout=5,
                          message="new project")

    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "region_agent", "zone", "--url", f"http://127.0.0.1:{agent.operator_port}",
        stdout=asyncio.subprocess.PIPE)
    out, _ = await cli.communicate()
    text = out.decode()
    assert cli.returncode == 0
    assert "shop.g.example.com  ha  primary=sfo1" in text
    assert "target sfo1   127.0.0.41" in text and "unhealthy" in text and "http 503" in text

    agent.process.send_signal(signal.SIGTERM)
    assert await wait_for(lambda: agent.process.poll() is not None, timeout=10, message="exit")
    assert agent.process.returncode == 0
    assert '"msg": "stopping"' in agent.log.read_text()


async def _answer_is(agent: Running, expected: set[str], name: str = "shop.g.example.com") -> bool:
    return await _answer(agent, name) == expected


async def _metric_at_least(agent: Running, name: str, value: float) -> bool:
    """Whether the sum of every series of ``name`` (all label values) reaches ``value``."""
    _status, text = await _get(agent, "/metrics")
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(name + " ") or line.startswith(name + "{"))
    return total >= value


@pytest.mark.parametrize(("env", "args", "message"), [
    ({"REGION_AGENT_REGION": "SFO"}, [], "region: Value error, region name 'SFO'"),
    ({"REGION_AGENT_DNS__PORT": "99999"}, [], "dns.port"),
    ({"REGION_AGENT_CHECKS__TIMEOUT": "9"}, [], "timeout must not exceed interval"),
    ({}, ["--zone-file", "/nonexistent.yaml"], "/nonexistent.yaml"),
])
def test_bad_settings_stop_start_up_with_the_field_named(env: dict[str, str], args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "region_agent", "run", *args], capture_output=True, text=True,
                            timeout=30, env={**os.environ, **env}, check=False,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2
    assert message in result.stderr


async def test_region_agent_health_runs_the_sidecar_fed_by_the_agent(agent: Running, tmp_path: Path) -> None:
    """`region-agent health` answers from the agent's feed and turns stale when the agent is gone."""
    await wait_for(lambda: _ready(agent), timeout=15, message="agent ready")
    agent.process.send_signal(signal.SIGTERM)
    await wait_for(lambda: agent.process.poll() is not None, timeout=10, message="in-process agent stopped")
    sidecar_port = free_port()
    env = {**os.environ, "REGION_AGENT_HEALTH__MODE": "sidecar",
           "REGION_AGENT_HEALTH__FEED_SOCKET": str(tmp_path / "feed.sock"),
           "REGION_AGENT_HEALTH__PORT": str(sidecar_port),
           "REGION_AGENT_HEALTH__OPERATOR_PORT": str(agent.operator_port),
           "REGION_AGENT_HEALTH__SIDECAR_OPERATOR_PORT": str(free_port()),
           "REGION_AGENT_HEALTH__STALE_AFTER_SECONDS": "1", "REGION_AGENT_HEALTH__HEARTBEAT_INTERVAL_SECONDS": "0.2",
           "REGION_AGENT_HEALTH__FEED_RECONNECT_MAX_SECONDS": "0.3",
           "REGION_AGENT_HEALTH__LISTEN_ADDRESSES": '["127.0.0.1"]'}
    config = tmp_path / "agent.yaml"
    root = Path(__file__).resolve().parents[2]
    with (tmp_path / "fed.log").open("wb") as fed_log, (tmp_path / "sidecar.log").open("wb") as sidecar_log:
        fed = subprocess.Popen([sys.executable, "-m", "region_agent", "run", "--config", str(config)], env=env,
                               cwd=root, stdout=fed_log, stderr=subprocess.STDOUT)
        sidecar = subprocess.Popen([sys.executable, "-m", "region_agent", "health", "--config", str(config)], env=env,
                                   cwd=root, stdout=sidecar_log, stderr=subprocess.STDOUT)
    side = Running(sidecar, agent.dns_port, sidecar_port, agent.zone, agent.copies, agent.log)
    try:
        await wait_for(lambda: _ready(side), timeout=15, message="sidecar ready")
        status, body = await _get(side, "/health/region")
        assert status == 200 and '"mode":"sidecar"' in body.replace(" ", "")
        fed.send_signal(signal.SIGTERM)
        assert await wait_for(lambda: _status_is(side, "/global-health/shop", 503, "stale"), timeout=10,
                              message="stale once the agent is gone")
    finally:
        for process in (fed, sidecar):
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)


async def _status_is(agent: Running, path: str, status: int, word: str) -> bool:
    got, body = await _get(agent, path)
    return got == status and word in body
