"""A fixture zone for the answer tests: three regions, projects in every mode and policy."""

from __future__ import annotations

import ipaddress
import time

import dns.message

from region_agent.globaldns.answer import answer, max_response_size, render
from region_agent.globaldns.compiler import ZoneConfig, compile_zone
from region_agent.globaldns.tables import IPAddress, ZoneTables
from region_agent.globaldns.wire import parse_query
from region_agent.state.hlc import HybridClock
from region_agent.state.model import AllDownPolicy, CopyHealth, Mode, Project, Region, copy_key, project_key, region_key
from region_agent.state.store import Store
from tests.fakes.dns_client import query_wire

ZONE = "g.example.com"
REGIONS = {
    "sfo1": Region("sfo1", ipv4=("192.0.2.11",), ipv6=("2001:db8::11",), ns_ipv4=("192.0.2.53",),
                   latitude=37.6, longitude=-122.4),
    "ams1": Region("ams1", ipv4=("192.0.2.12",), ns_ipv4=("192.0.2.54",), ns_ipv6=("2001:db8::54",),
                   latitude=52.3, longitude=4.8),
    "nrt1": Region("nrt1", ipv4=("192.0.2.13",), latitude=35.8, longitude=140.4),
}
ALL = ("sfo1", "ams1", "nrt1")


def store_with(projects: list[Project], health: dict[tuple[str, str], CopyHealth]) -> Store:
    store = Store(writer="standalone/test", clock=HybridClock(lambda: int(time.time() * 1000)))
    for region in REGIONS.values():
        store.put(region_key(region.name), region)
    for project in projects:
        store.put(project_key(project.slug), project)
    for (slug, region_name), copy in health.items():
        store.put(copy_key(slug, region_name), copy)
    return store


def ha(slug: str, policy: AllDownPolicy = AllDownPolicy.ALL) -> Project:
    return Project(slug, ALL, primary="sfo1", mode=Mode.HA, all_down=policy)


def proximity(slug: str, policy: AllDownPolicy = AllDownPolicy.ALL) -> Project:
    return Project(slug, ALL, mode=Mode.PROXIMITY, all_down=policy)


def up(*regions: str, failed: tuple[str, ...] = ()) -> dict[str, CopyHealth]:
    return {r: CopyHealth(True, "ok", failed) for r in regions}


def down(*regions: str) -> dict[str, CopyHealth]:
    return {r: CopyHealth(False, "down") for r in regions}


def tables_for(projects: list[Project], health: dict[str, dict[str, CopyHealth]], **kwargs: object) -> ZoneTables:
    flat = {(slug, region): copy for slug, copies in health.items() for region, copy in copies.items()}
    config = ZoneConfig(ZONE, startup_answer=kwargs.pop("startup_answer", AllDownPolicy.ALL))  # type: ignore[arg-type]
    return compile_zone(store_with(projects, flat).snapshot(), config, **kwargs)  # type: ignore[arg-type]


def ask(
    tables: ZoneTables,
    name: str,
    qtype: str = "A",
    *,
    source: str = "198.51.100.7",
    ecs: tuple[str, int] | None = None,
    use_edns: int | bool = True,
    payload: int = 1232,
    tcp: bool = False,
    rdclass: str = "IN",
) -> dns.message.Message:
    """Answer a dnspython-built query through the pure path and parse the reply with dnspython."""
    parsed = parse_query(query_wire(name, qtype, rdclass=rdclass, use_edns=use_edns, payload=payload, ecs=ecs))
    reply = answer(tables, parsed, source)
    wire = render(parsed, reply, max_size=max_response_size(parsed, tcp=tcp, our_payload=1232), our_payload=1232)
    return dns.message.from_wire(wire)


class PrefixLocator:
    """A stand-in GeoIP map for answer tests: fixed client networks → closest site order."""

    def __init__(self, table: dict[str, tuple[list[str], int]]) -> None:
        self.table = [(ipaddress.ip_network(net), order, scope) for net, (order, scope) in table.items()]
        self.calls = 0

    def choose(self, address: IPAddress, candidates: frozenset[str]) -> tuple[str | None, int]:
        self.calls += 1
        for network, order, scope in self.table:
            if address.version == network.version and address in network:
                for site in order:
                    if site in candidates:
                        return site, scope
        return None, 16
