"""A rolling restart of two agents behind one load balancer loses no DNS query.

The load balancer is what Kubernetes and a cloud load balancer do together: it sends each query
to an agent whose ``/readyz`` answered 200 at its last probe (every PROBE_INTERVAL). Each agent in
turn gets SIGTERM, drains (``/readyz`` 503 while DNS answers), exits, and is started again on the
same ports, while a resolver queries throughout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import dns.exception
import dns.rcode

from tests.conftest import wait_for
from tests.fakes.dns_client import ask, rdata_texts
from tests.fakes.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PROBE_INTERVAL = 0.2
DRAIN = 1.5  # several probe intervals: the balancer has dropped the agent before it stops answering
ZONE = """regions:
  sfo1: {ipv4: [127.0.0.41], ns_ipv4: [127.0.0.1]}
projects:
  shop: {regions: [sfo1], primary: sfo1, all_down: all}
"""


@dataclass
class Backend:
    name: str
    home: Path
    dns_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    operator_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.home.mkdir(exist_ok=True)
        (self.home / "zone.yaml").write_text(ZONE)
        (self.home / "agent.yaml").write_text(f"""
region: sfo1
zone_file: zone.yaml
shutdown_drain_seconds: {DRAIN}
dns: {{zone: g.example.com, listen_addresses: [127.0.0.1], port: {self.dns_port}}}
checks: {{host: runr-health.g.example.com, port: {free_port()}, interval: 0.5, timeout: 0.4}}
health: {{listen_addresses: [127.0.0.1], port: {self.http_port}, operator_port: {self.operator_port}}}
""")
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGION_AGENT_")}
        with (self.home / "agent.log").open("ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "region_agent", "run", "--config",
                                             str(self.home / "agent.yaml")], env=env, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)


class Balancer:
    """Queries go to the backends that were ready at the last probe, round robin."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self.ready: list[Backend] = []
        self.removed: set[str] = set()  # backends the probes took out at some point
        self.turn = 0

    async def probe_forever(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_INTERVAL)) as http:
            while True:
                ready = []
                for backend in self.backends:
                    try:
                        async with http.get(f"http://127.0.0.1:{backend.http_port}/readyz") as answer:
                            if answer.status == 200:
                                ready.append(backend)
                    except (aiohttp.ClientError, TimeoutError):
                        pass
                self.removed |= {b.name for b in self.ready if b not in ready}
                self.ready = ready
                await asyncio.sleep(PROBE_INTERVAL)

    async def query(self) -> str:
        """One resolver query through the balancer: the answer, or what went wrong."""
        if not self.ready:
            return "no backend"
        self.turn += 1
        backend = self.ready[self.turn % len(self.ready)]
        try:
            response = await ask(backend.dns_port, "shop.g.example.com", timeout=1.0)
        except (dns.exception.Timeout, OSError) as exc:
            return f"{backend.name}: {exc!r}"
        if response.rcode() != dns.rcode.NOERROR:
            return f"{backend.name}: {dns.rcode.to_text(response.rcode())}"
        return " ".join(sorted(rdata_texts(response)))


async def _restart(backend: Backend, balancer: Balancer) -> None:
    process = backend.process
    assert process is not None
    process.send_signal(signal.SIGTERM)
    await wait_for(lambda: process.poll() is not None, timeout=20, message=f"{backend.name} exits")
    assert process.returncode == 0
    backend.start()
    await wait_for(lambda: backend in balancer.ready, timeout=20, message=f"{backend.name} ready again")


async def test_a_rolling_restart_loses_no_query(tmp_path: Path) -> None:
    backends = [Backend("a", tmp_path / "a"), Backend("b", tmp_path / "b")]
    balancer = Balancer(backends)
    prober = asyncio.create_task(balancer.probe_forever())
    results: list[str] = []
    resolving = True

    async def resolver() -> None:
        while resolving:
            results.append(await balancer.query())
            await asyncio.sleep(0.005)

    try:
        for backend in backends:
            backend.start()
        await wait_for(lambda: len(balancer.ready) == 2, timeout=20, message="both agents ready")
        client = asyncio.create_task(resolver())
        for backend in backends:  # maxUnavailable 1: one agent at a time
            await _restart(backend, balancer)
        resolving = False
        await client
    finally:
        prober.cancel()
        for backend in backends:
            backend.kill()
    failed = [r for r in results if r != "127.0.0.41"]
    assert failed == [], f"{len(failed)} of {len(results)} queries failed: {failed[:5]}"
    assert len(results) > 100
    assert balancer.removed == {"a", "b"}  # each was taken out of the balancer, and queries went on
