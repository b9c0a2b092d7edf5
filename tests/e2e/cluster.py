"""A cluster of real ``region-agent`` processes on loopback addresses, joined by gossip.

Agent *i* runs region ``REGIONS[i]`` on ``127.0.0.(i+1)``: gossip (UDP and TCP), DNS and both
listeners bind that address; the region's copy is a fake health endpoint on ``127.0.0.(41+i)``
that only its own agent checks. The first agent imports the zone file (as the control role);
the others start with no zone at all and learn everything by gossip.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import dns.message

from region_agent.cli.keys import init_dir, issue_to_dir
from region_agent.demo.fake_copy import HealthEndpoint
from region_agent.gossip.keyring import generate_key
from tests.fakes.dns_client import answers, try_ask
from tests.fakes.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
APEX = "g.example.com"
REGIONS = ("sfo1", "ams1", "fra1", "nrt1", "syd1")


def zone_text(regions: tuple[str, ...], projects: dict[str, tuple[str, ...]]) -> str:
    lines = ["regions:"]
    for i, region in enumerate(regions):
        lines.append(f"  {region}: {{ipv4: [127.0.0.{41 + i}], ns_ipv4: [127.0.0.{i + 1}]}}")
    lines.append("projects:")
    for slug, where in projects.items():
        lines.append(f"  {slug}: {{regions: [{', '.join(where)}], mode: proximity}}")
    return "\n".join(lines) + "\n"


def identity_yaml(tmp: Path, region: str, node: str, *, ca: str = "ca") -> str:
    """The three gossip TLS lines of an agent's identity certificate (region, node) under the CA in
    ``tmp/<ca>`` (made on first use), indented for the ``gossip:`` block."""
    ca_dir = tmp / ca
    if not (ca_dir / "ca.pem").exists():
        init_dir(ca_dir)
    out = tmp / f"identity-{region}-{node}"
    if not (out / f"{region}-{node}.pem").exists():
        issue_to_dir(ca_dir, None, out, ips=[], dns=[], region=region, node=node)
    return (f"  tls_ca_file: {ca_dir / 'ca.pem'}\n  tls_cert_file: {out / f'{region}-{node}.pem'}\n"
            f"  tls_key_file: {out / f'{region}-{node}-key.pem'}\n")


def write_keyring(path: Path, keys: list[bytes], primary: bytes) -> None:
    encoded = [base64.b64encode(k).decode() for k in keys]
    path.write_text(json.dumps({"primary": base64.b64encode(primary).decode(), "keys": encoded}))
    path.chmod(0o600)


@dataclass
class Agent:
    index: int
    region: str
    host: str
    dns_port: int
    http_port: int
    operator_port: int
    gossip_port: int
    config: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None
    token: str | None = None   # the operator listener's bearer token, when it has one
    env: dict[str, str] = field(default_factory=dict)   # added to the process environment (e.g. faketime)

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "region_agent", "run", "--config", str(self.config)],
                                            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                            env={**env_without_drain(), **self.env})

    def describe(self, lines: int = 12) -> str:
        """Whether the process runs (or how it ended) and its last log lines but request logs: for a
        failure message, so a flaky wait says what each agent was doing."""
        state = "not started" if self.process is None else (
            "running" if self.process.poll() is None else f"exited {self.process.returncode}")
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        kept = [line[:300] for line in text.splitlines() if '"msg": "GET ' not in line and '"msg": "POST ' not in line]
        return "\n".join([f"agent{self.index} ({self.region}): {state}", *kept[-lines:]])

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)

    async def query(self, name: str, rdtype: str = "A") -> dns.message.Message | None:
        return await try_ask(self.dns_port, name, rdtype, host=self.host, timeout=0.5)

    async def answer(self, name: str, rdtype: str = "A") -> set[str] | None:
        return await answers(self.dns_port, name, rdtype, host=self.host, timeout=0.5)

    async def serial(self) -> int | None:
        response = await self.query(APEX, "SOA")
        if response is None or not response.answer:
            return None
        return int(response.answer[0][0].serial)

    async def get(self, path: str, *, operator: bool = False) -> tuple[int, str]:
        port = self.operator_port if operator else self.http_port
        headers = {"Authorization": f"Bearer {self.token}"} if operator and self.token else {}
        try:
            async with aiohttp.ClientSession(headers=headers) as http, \
                    http.get(f"http://{self.host}:{port}{path}", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0, ""

    async def ready(self) -> bool:
        return (await self.get("/readyz"))[0] == 200

    async def region_view(self) -> dict[str, object] | None:
        status, body = await self.get("/health/region", operator=True)
        return json.loads(body) if status in (200, 503) and body else None

    async def metric(self, name: str, labels: str = "") -> float:
        _status, body = await self.get("/metrics", operator=True)
        total = 0.0
        for line in body.splitlines():
            if line.startswith(name) and labels in line and not line.startswith("#"):
                head, _, value = line.rpartition(" ")
                if head.split("{")[0] == name:
                    total += float(value)
        return total


@dataclass
class Cluster:
    tmp: Path
    agents: list[Agent] = field(default_factory=list)
    copies: list[HealthEndpoint] = field(default_factory=list)
    check_port: int = 0

    async def start_copies(self, count: int) -> None:
        first = HealthEndpoint("127.0.0.41")
        self.check_port = await first.start()
        self.copies.append(first)
        for i in range(1, count):
            copy = HealthEndpoint(f"127.0.0.{41 + i}", self.check_port)
            await copy.start()
            self.copies.append(copy)

    def add(self, index: int, *, zone_file: Path | None, keyring: Path, seeds: list[str], extra: str = "",
            token_file: Path | None = None, state_file: Path | None = None, check_interval: float = 0.5,
            check_timeout: float = 0.5, region: str | None = None) -> Agent:
        """Agent ``index`` on 127.0.0.(index+1), of region ``REGIONS[index]`` unless ``region`` says (a second
        agent of a region)."""
        host = f"127.0.0.{index + 1}"
        region = region or REGIONS[index]
        agent = Agent(index, region, host, free_port(), free_port(), free_port(), free_port(),
                      self.tmp / f"agent{index}.yaml", self.tmp / f"agent{index}.log")
        zone_line = f"zone_file: {zone_file}\nzone_file_poll_interval: 0.2\n" if zone_file else ""
        if state_file is not None:
            zone_line += f"state_file: {state_file}\nstate_file_interval: 0.5\n"
        agent.config.write_text(f"""
region: {region}
node: n{index}
{zone_line}dns: {{zone: {APEX}, listen_addresses: [{host}], port: {agent.dns_port}}}
checks: {{host: runr-health.{APEX}, port: {self.check_port}, interval: {check_interval}, timeout: {check_timeout}}}
health: {{listen_addresses: [{host}], port: {agent.http_port}, operator_listen_addresses: [{host}],
          operator_port: {agent.operator_port}{f", operator_token_file: {token_file}" if token_file else ""}}}
gossip:
  enabled: true
  bind_address: {host}
  port: {agent.gossip_port}
  preset: lan
  keyring_file: {keyring}
  seeds: [{", ".join(seeds)}]
  sync_interval: 1.0
  ready_sync_timeout: 3.0
{"" if "tls_ca_file" in extra else identity_yaml(self.tmp, region, f"n{index}")}{extra}""")
        if token_file is not None:
            agent.token = token_file.read_text().strip()
        self.agents.append(agent)
        return agent

    async def stop(self) -> None:
        for agent in self.agents:
            agent.terminate()
        for copy in self.copies:
            await copy.stop()


def env_without_drain() -> dict[str, str]:
    return {**os.environ, "REGION_AGENT_SHUTDOWN_DRAIN_SECONDS": "0"}


async def gather_answers(agents: list[Agent], name: str) -> list[set[str] | None]:
    return list(await asyncio.gather(*(a.answer(name) for a in agents)))


async def three_regions(tmp: Path, *, token: str | None = None, extra: tuple[str, str, str] = ("", "", ""),
                        ) -> Cluster:
    """Copies for sfo1, ams1 and fra1, a keyring, a zone file of ``shop`` in all three, and three agent
    configs (not started): agent 0 imports the zone file, the others join through it. ``token``: the
    operator token they all take; ``extra``: more settings per agent (see :meth:`Cluster.add`)."""
    c = Cluster(tmp)
    await c.start_copies(3)
    key = generate_key()
    ring = tmp / "keyring.json"
    write_keyring(ring, [key], key)
    token_file = None
    if token is not None:
        token_file = tmp / "token"
        token_file.write_text(token + "\n")
    zone = tmp / "zone.yaml"
    zone.write_text(zone_text(REGIONS[:3], {"shop": REGIONS[:3]}))
    first = c.add(0, zone_file=zone, keyring=ring, seeds=[], token_file=token_file, extra=extra[0])
    seeds = [f"{first.host}:{first.gossip_port}"]
    for index in (1, 2):
        c.add(index, zone_file=None, keyring=ring, seeds=seeds, token_file=token_file, extra=extra[index])
    return c
