"""A rollout loses no DNS answer: on SIGTERM the agent reports not ready, keeps answering, then exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.conftest import wait_for
from tests.fakes.dns_client import answers
from tests.fakes.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DRAIN = 4.0
ZONE = """
regions:
  sfo1: {ipv4: [127.0.0.41], ns_ipv4: [127.0.0.1]}
projects:
  shop: {regions: [sfo1], primary: sfo1, all_down: all}
"""


def _start(tmp_path: Path, drain: float, extra_env: dict[str, str] | None = None,
           ) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """``region-agent run`` with ``drain`` seconds of shutdown drain: (process, DNS port, public port, log)."""
    (tmp_path / "zone.yaml").write_text(ZONE)
    dns_port, http_port, operator_port, check_port = free_port(), free_port(), free_port(), free_port()
    config = tmp_path / "agent.yaml"
    config.write_text(f"""
region: sfo1
zone_file: zone.yaml
shutdown_drain_seconds: {drain}
dns: {{zone: g.example.com, listen_addresses: [127.0.0.1], port: {dns_port}}}
checks: {{host: runr-health.g.example.com, port: {check_port}, interval: 0.5, timeout: 0.4}}
health: {{listen_addresses: [127.0.0.1], port: {http_port}, operator_port: {operator_port}}}
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGION_AGENT_")}  # not the tests' drain 0
    env.update(extra_env or {})
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "region_agent", "run", "--config", str(config)], env=env,
                                   stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    return process, dns_port, http_port, log


async def _readyz(port: int) -> tuple[int, str]:
    try:
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{port}/readyz", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status, await r.text()
    except aiohttp.ClientError:
        return 0, ""


async def _answers(port: int) -> set[str]:
    return await answers(port, "shop.g.example.com", timeout=0.5) or set()


async def test_sigterm_drains_then_exits(tmp_path: Path) -> None:
    process, dns_port, http_port, log = _start(tmp_path, DRAIN)
    try:
        await wait_for(lambda: _ready(http_port), timeout=15, message="/readyz 200")
        assert await _answers(dns_port) == {"127.0.0.41"}

        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        answer = await wait_for(lambda: _draining(http_port), timeout=DRAIN, message="/readyz draining")
        assert answer == (503, "not ready: draining")
        # Still answering while the load balancer drops it, and still not exited.
        assert await _answers(dns_port) == {"127.0.0.41"}
        assert process.poll() is None, log.read_text()
        assert (await _readyz(http_port))[0] == 503

        await wait_for(lambda: process.poll() is not None, timeout=DRAIN + 15, message="exit after the drain")
        elapsed = time.monotonic() - signalled
        assert process.returncode == 0, log.read_text()
        assert elapsed >= DRAIN * 0.9, f"exited {elapsed:.2f} s after SIGTERM, before the {DRAIN} s drain"
        messages = [json.loads(line)["msg"] for line in log.read_text().splitlines() if line.startswith("{")]
        drained = next(i for i, m in enumerate(messages) if m.startswith("draining for"))
        assert messages.index("stopping") > drained
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)


async def _ready(port: int) -> bool:
    return (await _readyz(port))[0] == 200


async def _draining(port: int) -> tuple[int, str] | None:
    answer = await _readyz(port)
    return answer if answer[0] == 503 else None


async def test_a_second_sigterm_ends_the_drain(tmp_path: Path) -> None:
    process, _dns_port, http_port, log = _start(tmp_path, 60)
    try:
        await wait_for(lambda: _ready(http_port), timeout=15, message="/readyz 200")
        process.send_signal(signal.SIGTERM)
        await wait_for(lambda: _draining(http_port), timeout=10, message="/readyz draining")
        process.send_signal(signal.SIGTERM)
        await wait_for(lambda: process.poll() is not None, timeout=15, message="exit on the second SIGTERM")
        assert process.returncode == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)


async def test_the_health_sidecar_reports_the_drain(tmp_path: Path) -> None:
    """With `health.mode: sidecar` (the chart's healthSidecar), the sidecar's /readyz follows the agent's drain."""
    process, dns_port, _http_port, log = _start(tmp_path, DRAIN, extra_env={
        "REGION_AGENT_HEALTH__MODE": "sidecar", "REGION_AGENT_HEALTH__FEED_SOCKET": str(tmp_path / "feed.sock"),
        "REGION_AGENT_HEALTH__SIDECAR_OPERATOR_PORT": str(free_port())})
    sidecar_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGION_AGENT_")}
    env.update({"REGION_AGENT_HEALTH__MODE": "sidecar", "REGION_AGENT_HEALTH__FEED_SOCKET": str(tmp_path / "feed.sock"),
                "REGION_AGENT_HEALTH__PORT": str(sidecar_port),
                "REGION_AGENT_HEALTH__SIDECAR_OPERATOR_PORT": str(free_port())})
    with (tmp_path / "sidecar.log").open("wb") as out:
        sidecar = subprocess.Popen([sys.executable, "-m", "region_agent", "health", "--config",
                                    str(tmp_path / "agent.yaml")], env=env, cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        await wait_for(lambda: _ready(sidecar_port), timeout=15, message="sidecar /readyz 200")
        process.send_signal(signal.SIGTERM)
        answer = await wait_for(lambda: _draining(sidecar_port), timeout=DRAIN, message="sidecar /readyz draining")
        assert answer == (503, "not ready: draining")
        assert process.poll() is None, log.read_text()
        assert await _answers(dns_port) == {"127.0.0.41"}
        await wait_for(lambda: process.poll() is not None, timeout=DRAIN + 15, message="agent exits after the drain")
        assert process.returncode == 0, log.read_text()
    finally:
        for child in (process, sidecar):
            if child.poll() is None:
                child.kill()
                child.wait(timeout=5)
