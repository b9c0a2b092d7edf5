"""Clusters of any size: :class:`tests.e2e.cluster.Cluster` for more agents than regions, and with ACME.

Agent *i* is node ``n<i>`` of region ``REGIONS[i % 5]`` on :func:`agent_host` ``(i)``
(``127.0.0.(i+1)`` for the first 40, as in ``cluster.py``; then ``127.0.2.x``, since the copies hold
``127.0.0.41`` and up). Past five agents a region has several, as a DaemonSet has; region *r*'s
one fake copy stays on ``127.0.0.(41+r)`` and every agent of that region checks it. Every agent
may carry the same TSIG key for RFC 2136 (``dns.acme``), so an UPDATE can go to any of them.
Used by ``tests/e2e/test_acme_cluster.py`` and ``bench/gossip_cluster.py`` (N up to 50).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.e2e.cluster import APEX, REGIONS, Agent, Cluster, identity_yaml, write_keyring, zone_text
from tests.fakes.ports import free_port


def agent_host(index: int) -> str:
    """Agent *index*'s address: 127.0.0.1-40, then 127.0.2.1-254."""
    if not 0 <= index < 40 + 254:
        raise ValueError(f"agent index {index} out of range")
    return f"127.0.0.{index + 1}" if index < 40 else f"127.0.2.{index - 39}"


def agent_region(index: int) -> str:
    return REGIONS[index % len(REGIONS)]


@dataclass(frozen=True)
class Tsig:
    """One RFC 2136 key, as in ``dns.acme.tsig_keys``."""

    name: str
    algorithm: str   # e.g. "hmac-md5", as cert-manager's "HMACMD5"
    secret: str      # base64


class Fleet(Cluster):
    """N agents: agent 0 imports the zone file (``projects`` in every region it lists), the others
    start empty and join through agent 0 as their only seed."""

    def add_agent(self, index: int, *, zone_file: Path | None, keyring: Path, seeds: list[str],
                  tsig: Tsig | None = None, sync_interval: float = 1.0, check_interval: float = 0.5,
                  log_level: str = "info") -> Agent:
        host = agent_host(index)
        region = agent_region(index)
        agent = Agent(index, region, host, free_port(), free_port(), free_port(), free_port(),
                      self.tmp / f"agent{index}.yaml", self.tmp / f"agent{index}.log")
        zone_line = f"zone_file: {zone_file}\nzone_file_poll_interval: 0.2\n" if zone_file else ""
        acme = (f", acme: {{tsig_keys: [{{name: {tsig.name}, algorithm: {tsig.algorithm}, "
                f"secret: '{tsig.secret}'}}]}}" if tsig else "")
        agent.config.write_text(f"""
region: {region}
node: n{index}
log_level: {log_level}
{zone_line}dns: {{zone: {APEX}, listen_addresses: [{host}], port: {agent.dns_port}{acme}}}
checks: {{host: runr-health.{APEX}, port: {self.check_port}, interval: {check_interval}, timeout: 0.5}}
health: {{listen_addresses: [{host}], port: {agent.http_port}, operator_listen_addresses: [{host}],
          operator_port: {agent.operator_port}}}
gossip:
  enabled: true
  bind_address: {host}
  port: {agent.gossip_port}
  preset: lan
  keyring_file: {keyring}
  seeds: [{", ".join(seeds)}]
  sync_interval: {sync_interval}
  ready_sync_timeout: 3.0
{identity_yaml(self.tmp, region, f"n{index}")}""")
        self.agents.append(agent)
        return agent

    async def build(self, count: int, *, key: bytes, projects: tuple[str, ...] = ("shop",),
                    tsig: Tsig | None = None, sync_interval: float = 1.0, check_interval: float = 0.5,
                    log_level: str = "info") -> list[Agent]:
        """Copies for every region in use, a keyring, a zone file and ``count`` agent configs (not started)."""
        regions = REGIONS[:min(count, len(REGIONS))]
        await self.start_copies(len(regions))
        ring = self.tmp / "keyring.json"
        write_keyring(ring, [key], key)
        zone = self.tmp / "zone.yaml"
        zone.write_text(zone_text(regions, dict.fromkeys(projects, regions)))
        seeds: list[str] = []
        for index in range(count):
            agent = self.add_agent(index, zone_file=zone if index == 0 else None, keyring=ring, seeds=seeds,
                                   tsig=tsig, sync_interval=sync_interval, check_interval=check_interval,
                                   log_level=log_level)
            if index == 0:
                seeds = [f"{agent.host}:{agent.gossip_port}"]
        return self.agents


    async def stop(self) -> None:
        """SIGTERM to every agent at once, then wait for each (SIGKILL after 15 s), then the copies."""
        for agent in self.agents:
            if agent.process is not None and agent.process.poll() is None:
                agent.process.terminate()
        await super().stop()


def copy_address(region_index: int) -> str:
    return f"127.0.0.{41 + region_index}"
