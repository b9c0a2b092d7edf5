"""The delegation of the global zone: the records its parent zone must hold, and how they compare.

The parent zone (``example.com`` for ``g.example.com``) delegates the global zone with one NS
record per region that has a name-server address, ``ns-<region>.<zone>``, and, because those
names lie inside the delegated zone, the glue A/AAAA records of each. They are the same NS set
and glue the agents answer at the apex (:mod:`region_agent.globaldns.compiler`), so the parent and the
child agree. Pure: no I/O; the CLI prints :func:`delegation_lines`, the periodic check
(:mod:`region_agent.globaldns.reachability`) compares what a resolver sees with :func:`expected_ns_names`
by :func:`delegation_state`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from region_agent.globaldns.compiler import ns_host
from region_agent.state.model import Region

DEFAULT_TTL = 3600  # as dns.ns_ttl: the NS and glue TTL the agents answer with


class DelegationState(StrEnum):
    OK = "ok"  # every expected name server is delegated to
    PARTIAL = "partial"  # some expected name servers are missing from the parent's NS set
    MISSING = "missing"  # the parent delegates to none of them (or not at all)
    UNKNOWN = "unknown"  # the resolver did not answer: nothing is known about the delegation


@dataclass(frozen=True, slots=True)
class NameServer:
    host: str  # ns-<region>.<zone>, without the final dot
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()


def _zone(zone: str) -> str:
    zone = zone.strip().rstrip(".").lower()
    if not zone:
        raise ValueError("the zone name is empty")
    return zone


def name_servers(regions: Iterable[Region], zone: str) -> list[NameServer]:
    """One name server per region with a name-server address, sorted by host name."""
    zone = _zone(zone)
    found = [NameServer(ns_host(r.name, zone), r.ns_ipv4, r.ns_ipv6) for r in regions if r.ns_ipv4 or r.ns_ipv6]
    return sorted(found, key=lambda server: server.host)


def name_servers_from_zone_document(data: Mapping[str, Any]) -> tuple[str, list[NameServer]]:
    """The zone name and its name servers from a running agent's ``/zone`` document.

    ``/zone`` lists each name server as a record of type ``NS glue`` with its addresses.
    """
    zone = data.get("zone")
    if not isinstance(zone, str) or not zone:
        raise ValueError("the /zone document names no zone")
    servers = []
    for record in data.get("records", []):
        if not isinstance(record, Mapping) or record.get("type") != "NS glue":
            continue
        addresses = [str(a) for a in record.get("addresses", [])]
        ipv4 = tuple(a for a in addresses if ipaddress.ip_address(a).version == 4)
        ipv6 = tuple(a for a in addresses if ipaddress.ip_address(a).version == 6)
        servers.append(NameServer(str(record["name"]).rstrip(".").lower(), ipv4, ipv6))
    return _zone(zone), sorted(servers, key=lambda server: server.host)


def delegation_lines(zone: str, servers: Iterable[NameServer], ttl: int = DEFAULT_TTL) -> list[str]:
    """The parent zone's records in zone-file syntax: the NS set first, then each server's glue."""
    zone = _zone(zone)
    servers = list(servers)
    lines = [f"{zone}.\t{ttl}\tIN\tNS\t{server.host}." for server in servers]
    for server in servers:
        lines += [f"{server.host}.\t{ttl}\tIN\tA\t{address}" for address in server.ipv4]
        lines += [f"{server.host}.\t{ttl}\tIN\tAAAA\t{address}" for address in server.ipv6]
    return lines


def expected_ns_names(regions: Iterable[Region], zone: str) -> frozenset[str]:
    return frozenset(server.host for server in name_servers(regions, zone))


def normalise_name(name: str) -> str:
    return name.rstrip(".").lower()


def delegation_state(expected: Iterable[str], seen: Iterable[str]) -> DelegationState:
    """Compare the NS names the parent delegates to with the expected ones (case and final dot ignored).

    Names the parent lists beyond the expected ones do not make a delegation partial: every
    expected server is reachable through it (they are reported beside the state).
    """
    want = {normalise_name(n) for n in expected}
    have = {normalise_name(n) for n in seen}
    if not want:
        return DelegationState.MISSING  # no region has a name-server address: nothing to delegate to
    present = want & have
    if present == want:
        return DelegationState.OK
    return DelegationState.PARTIAL if present else DelegationState.MISSING
