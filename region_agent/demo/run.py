"""``region-agent demo``: the agent on its embedded default, with copies that fail and recover.

Starts one fake copy per demo region (an HTTP endpoint answering
``/global-health/<slug>`` on the region's ingress address), runs the agent on
``region_agent/demo/agent.yaml``, and walks the copies through a script of failures, printing what
the zone answers after each step, so a newcomer sees failover happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import dns.asyncquery
import dns.message
import dns.rcode
import dns.rdatatype

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from region_agent.demo.fake_copy import HealthEndpoint
from region_agent.zonefile.watcher import read_zone_file

# (region states after the step, what a reader should notice)
SCRIPT: list[tuple[dict[str, bool], str]] = [
    ({"sfo1": True, "ams1": True, "nrt1": True}, "all copies healthy: shop answers its primary, sfo1"),
    ({"sfo1": False, "ams1": True, "nrt1": True}, "sfo1 fails: shop fails over to the backups"),
    ({"sfo1": False, "ams1": False, "nrt1": True}, "ams1 fails too: only nrt1 is left"),
    ({"sfo1": False, "ams1": False, "nrt1": False}, "everything is down: shop answers every address "
                                                    "(all_down: all), blog SERVFAILs (all_down: servfail)"),
    ({"sfo1": True, "ams1": True, "nrt1": True}, "all recover: back to the primary"),
]


async def answer_of(server: str, port: int, name: str) -> str:
    query = dns.message.make_query(name, dns.rdatatype.A)
    try:
        response = await dns.asyncquery.udp(query, server, port=port, timeout=1.0)
    except Exception as exc:
        return f"no answer ({type(exc).__name__})"
    if response.rcode() != dns.rcode.NOERROR:
        return dns.rcode.to_text(response.rcode())
    addresses = sorted(str(rdata) for rrset in response.answer for rdata in rrset)
    return " ".join(addresses) or "NODATA"


async def run_demo(settings: AgentSettings, *, step_seconds: float, rounds: int) -> int:
    if settings.zone_file is None:
        print("the demo needs a zone file (region_agent/demo/agent.yaml sets one)", file=sys.stderr)
        return 2
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
              f"  dig @{server} -p {port} shop.{settings.dns.zone} A\n"
              f"  curl -s http://{settings.health.operator_listen_addresses[0]}:{settings.health.operator_port}/metrics\n",
              flush=True)
        for _ in range(rounds):
            for states, note in SCRIPT:
                for name, healthy in states.items():
                    if name in copies:
                        copies[name].set("ok" if healthy else "down")
                print(f"* {note}", flush=True)
                await asyncio.sleep(step_seconds)
                for slug in zone.projects:
                    answer = await answer_of(server, port, f"{slug}.{settings.dns.zone}")
                    print(f"    {slug}.{settings.dns.zone} A -> {answer}", flush=True)
        return 0
    finally:
        await agent.stop()
        for copy in copies.values():
            with contextlib.suppress(Exception):
                await copy.stop()
