"""``region-agent demo``: the agent on its embedded default, with copies that fail and recover.

Starts one fake copy per demo region (an HTTP endpoint answering
``/global-health/<slug>`` on the region's ingress address), runs the agent on
``region_agent/demo/agent.yaml``, and walks the copies through a script of failures, printing what
the zone answers after each step, so a newcomer sees failover happen, and how long it took. Unless the
settings name a GeoIP database, it writes a small one (:data:`CLIENTS`: one test network near each
region) so the proximity project answers each client from its nearest healthy region.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import dns.asyncquery
import dns.edns
import dns.message
import dns.rcode
import dns.rdatatype

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from region_agent.demo.fake_copy import HealthEndpoint
from region_agent.demo.mmdb_writer import MmdbWriter, city_record
from region_agent.zonefile.watcher import read_zone_file

# Clients of the demo's GeoIP database: (EDNS client subnet, where it is), near sfo1, ams1, nrt1.
CLIENTS = (("192.0.2.0/24", "San Jose", 37.34, -121.89), ("198.51.100.0/24", "Rotterdam", 51.92, 4.48),
           ("203.0.113.0/24", "Tokyo", 35.68, 139.69))
FAILOVER_POLL = 0.05

# (region states after the step, what a reader should notice)
SCRIPT: list[tuple[dict[str, bool], str]] = [
    ({"sfo1": True, "ams1": True, "nrt1": True}, "all copies healthy: shop answers its primary, sfo1"),
    ({"sfo1": False, "ams1": True, "nrt1": True}, "sfo1 fails: shop fails over to the backups"),
    ({"sfo1": False, "ams1": False, "nrt1": True}, "ams1 fails too: only nrt1 is left"),
    ({"sfo1": False, "ams1": False, "nrt1": False}, "everything is down: shop answers every address "
                                                    "(all_down: all), blog SERVFAILs (all_down: servfail)"),
    ({"sfo1": True, "ams1": True, "nrt1": True}, "all recover: back to the primary"),
]


def write_geoip(directory: Path) -> Path:
    """The demo's GeoIP database: one city per client network of :data:`CLIENTS`."""
    writer = MmdbWriter(database_type="GeoLite2-City")
    for network, city, latitude, longitude in CLIENTS:
        writer.insert(network, city_record(city, latitude, longitude))
    path = directory / "demo-geoip.mmdb"
    writer.write(path)
    return path


async def answer_of(server: str, port: int, name: str, subnet: str | None = None) -> str:
    options = [] if subnet is None else [dns.edns.ECSOption.from_text(subnet)]
    query = dns.message.make_query(name, dns.rdatatype.A, use_edns=0 if options else None, options=options)
    try:
        response = await dns.asyncquery.udp(query, server, port=port, timeout=1.0)
    except Exception as exc:
        return f"no answer ({type(exc).__name__})"
    if response.rcode() != dns.rcode.NOERROR:
        return dns.rcode.to_text(response.rcode())
    addresses = sorted(str(rdata) for rrset in response.answer for rdata in rrset)
    return " ".join(addresses) or "NODATA"


def _commands(settings: AgentSettings, config: str | None) -> str:
    server, port, zone = settings.dns.listen_addresses[0], settings.dns.port, settings.dns.zone
    operator = f"http://{settings.health.operator_listen_addresses[0]}:{settings.health.operator_port}"
    with_config = f" --config {config}" if config else ""
    lines = [
        (f"dig @{server} -p {port} shop.{zone} A", "HA: the primary while it is healthy"),
        (f"dig @{server} -p {port} blog.{zone} A +subnet={CLIENTS[2][0]}", "proximity: the region nearest Tokyo"),
        (f"dig @{server} -p {port} {zone} NS", "name servers with glue"),
        (f"dig @{server} -p {port} nope.{zone} A", "NXDOMAIN with the SOA"),
        (f"region-agent zone{with_config}", "the zone as answered now, each target's health"),
        (f"curl -s {operator}/metrics | grep region_agent_dns", "the operator listener"),
        (f"open {operator}/status", "the status page, in a browser"),
    ]
    width = max(len(command) for command, _ in lines)
    return "\n".join(f"  {command.ljust(width)}   # {why}" for command, why in lines)


async def _failover_time(server: str, port: int, name: str, before: str, limit: float) -> float | None:
    """Seconds until ``name`` stops answering ``before`` (polled), or None within ``limit``."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if await answer_of(server, port, name) != before:
            return time.monotonic() - started
        await asyncio.sleep(FAILOVER_POLL)
    return None


async def run_demo(settings: AgentSettings, *, step_seconds: float, rounds: int, config: str | None = None) -> int:
    if settings.zone_file is None:
        print("the demo needs a zone file (region_agent/demo/agent.yaml sets one)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="region-agent-demo-") as scratch:
        geoip = settings.dns.geoip
        if settings.dns.geoip_database is None and not (geoip.source or geoip.file or geoip.url or geoip.url_file):
            settings = settings.model_copy(update={"dns": settings.dns.model_copy(
                update={"geoip_database": write_geoip(Path(scratch))})})
        return await _run_demo(settings, step_seconds=step_seconds, rounds=rounds, config=config)


async def _run_demo(settings: AgentSettings, *, step_seconds: float, rounds: int, config: str | None) -> int:
    assert settings.zone_file is not None
    zone = read_zone_file(settings.zone_file)
    copies = {name: HealthEndpoint(region.ipv4[0], settings.checks.port) for name, region in zone.regions.items()
              if region.ipv4}
    for copy in copies.values():
        await copy.start()
    agent = Agent(settings)
    server, port = settings.dns.listen_addresses[0], settings.dns.port
    try:
        await agent.start()
        await asyncio.wait_for(agent.ready.wait(), settings.checks.timeout * 3 + 5)
        print(f"region-agent is answering {settings.dns.zone} on {server} port {port}. Try:\n"
              f"{_commands(settings, config)}\n", flush=True)
        shop = f"shop.{settings.dns.zone}"
        for _ in range(rounds):
            for index, (states, note) in enumerate(SCRIPT):
                before = await answer_of(server, port, shop)
                for name, healthy in states.items():
                    if name in copies:
                        copies[name].set("ok" if healthy else "down")
                print(f"* {note}", flush=True)
                if index == 1:   # sfo1 fails: time the failover as a client sees it
                    took = await _failover_time(server, port, shop, before, limit=step_seconds * 3)
                    print("    failover: " + ("shop still answers sfo1" if took is None else
                                              f"shop left sfo1 {took:.1f} s after its copy failed (checks every "
                                              f"{settings.checks.interval:g} s, down after {settings.checks.fall})"),
                          flush=True)
                await asyncio.sleep(step_seconds)
                for slug in zone.projects:
                    answer = await answer_of(server, port, f"{slug}.{settings.dns.zone}")
                    print(f"    {slug}.{settings.dns.zone} A -> {answer}", flush=True)
                if settings.dns.geoip_database is not None:
                    near = [f"{city} -> {await answer_of(server, port, f'blog.{settings.dns.zone}', subnet)}"
                            for subnet, city, _lat, _lon in CLIENTS]
                    print(f"    blog.{settings.dns.zone} A by client: " + "; ".join(near), flush=True)
        return 0
    finally:
        await agent.stop()
        for copy in copies.values():
            with contextlib.suppress(Exception):
                await copy.stop()
