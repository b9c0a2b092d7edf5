"""``dns.workers: 2`` in a real ``region-agent run``: two worker processes answer on one port and share
the load, a copy going down reaches both, signed ACME UPDATEs sent to either are forwarded to the main
process (the store) and answered, and a worker killed with SIGKILL is restarted and counted."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from region_agent.demo.fake_copy import HealthEndpoint
from tests.conftest import wait_for
from tests.fakes.dns_client import TsigKey, ask, signed, try_ask, txt_update, txt_values
from tests.fakes.ports import free_port

pytestmark = pytest.mark.external

ROOT = Path(__file__).resolve().parents[2]
ZONE = "g.example.com"
SECRET = base64.b64encode(b"workers-test-secret-0123456789ab").decode()
KEY = TsigKey("acme-key", SECRET)


async def _metrics(port: int) -> dict[str, float]:
    try:
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("region_agent_dns_worker") or line.startswith("region_agent_dns_workers"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid=,args="], capture_output=True, text=True,
                         check=False).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "worker_main" in line]


async def test_two_workers_share_the_port_follow_changes_forward_updates_and_come_back(tmp_path: Path) -> None:
    copy = HealthEndpoint("127.0.0.71")
    check_port = await copy.start()
    backup = HealthEndpoint("127.0.0.72", check_port)
    await backup.start()
    dns_port, operator = free_port(), free_port()
    (tmp_path / "zone.yaml").write_text("regions:\n  sfo1: {ipv4: [127.0.0.71], ns_ipv4: [127.0.0.1]}\n"
                                        "  ams1: {ipv4: [127.0.0.72]}\n"
                                        "projects:\n  shop: {regions: [sfo1, ams1], primary: sfo1}\n")
    (tmp_path / "agent.yaml").write_text(f"""
region: sfo1
zone_file: zone.yaml
dns:
  zone: {ZONE}
  listen_addresses: [127.0.0.1]
  port: {dns_port}
  workers: 2
  acme: {{tsig_keys: [{{name: acme-key, algorithm: hmac-sha256, secret: "{SECRET}"}}]}}
checks: {{host: runr-health.{ZONE}, port: {check_port}, interval: 0.3, timeout: 0.3}}
health: {{listen_addresses: [127.0.0.1], port: {free_port()}, operator_port: {operator}}}
""")
    agent = subprocess.Popen([sys.executable, "-m", "region_agent", "run", "--config", "agent.yaml"], cwd=tmp_path,
                             env={**os.environ, "REGION_AGENT_SHUTDOWN_DRAIN_SECONDS": "0"},
                             stdout=(tmp_path / "agent.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        async def answers(expected: set[str]) -> bool:
            response = await try_ask(dns_port, f"shop.{ZONE}", timeout=0.5)
            return response is not None and {str(r) for rrset in response.answer for r in rrset} == expected
        await wait_for(lambda: answers({"127.0.0.71"}), timeout=30, interval=0.2, message="the workers answer")
        for _ in range(100):   # a new source port each: the kernel spreads them over both sockets
            await ask(dns_port, f"shop.{ZONE}")
        async def per_worker() -> list[float]:
            counts = await _metrics(operator)
            return [counts.get(f'region_agent_dns_worker_responses_total{{worker="{w}"}}', 0) for w in ("0", "1")]

        async def both_answered() -> bool:   # the workers report their counts to the main process now and then
            return sum(await per_worker()) >= 100
        await wait_for(both_answered, timeout=10, interval=0.2, message="the workers' counts")
        assert min(await per_worker()) >= 20, await per_worker()   # both answer a fair share

        # Signed UPDATEs: whichever worker gets one forwards it to the main process and answers it.
        for n in range(6):
            update = signed(txt_update(ZONE, f"_acme-challenge.{ZONE}.", "add", f"token-{n}"), KEY)
            response = await ask(dns_port, update)
            assert response.rcode() == 0 and response.had_tsig, response
        async def all_six() -> bool:   # the store has them at the answer; the workers' tables a delta later
            response = await ask(dns_port, f"_acme-challenge.{ZONE}", "TXT")
            return txt_values(response) == {f"token-{n}" for n in range(6)}
        await wait_for(all_six, timeout=5, interval=0.05, message="the six challenges answered")
        async def forwarded() -> bool:
            metrics = await _metrics(operator)
            return sum(v for k, v in metrics.items() if k.startswith("region_agent_dns_worker_forwarded_updates")) >= 6
        await wait_for(forwarded, timeout=10, interval=0.2, message="six UPDATEs forwarded")

        copy.set("down")   # the primary down: every worker fails over to ams1
        await wait_for(lambda: _all_answer(dns_port, {"127.0.0.72"}), timeout=10, interval=0.1,
                       message="both workers fail over")

        victim = _children(agent.pid)[0]
        os.kill(victim, signal.SIGKILL)
        await wait_for(lambda: _restarted(agent.pid, victim, operator), timeout=20, interval=0.2,
                       message="the killed worker restarted and counted")
        # the restarted worker starts from a full snapshot: the failover holds in every worker
        await wait_for(lambda: _all_answer(dns_port, {"127.0.0.72"}), timeout=10, interval=0.2,
                       message="both workers answering again, failed over")
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
        await copy.stop()
        await backup.stop()
        for pid in _children(agent.pid):   # none should be left; by PID if so
            os.kill(pid, signal.SIGKILL)


async def _all_answer(port: int, expected: set[str]) -> bool:
    """40 queries, each from its own source port (the kernel spreads them over both workers), all say so."""
    results = await asyncio.gather(*(try_ask(port, f"shop.{ZONE}", timeout=0.5) for _ in range(40)))
    return all(r is not None and {str(x) for rrset in r.answer for x in rrset} == expected for r in results)


async def _restarted(pid: int, victim: int, operator: int) -> bool:
    children = _children(pid)
    metrics = await _metrics(operator)
    restarts = sum(v for k, v in metrics.items() if k.startswith("region_agent_dns_worker_restarts_total"))
    return len(children) == 2 and victim not in children and restarts >= 1
