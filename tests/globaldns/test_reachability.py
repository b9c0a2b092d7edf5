"""Reachability (SOA over UDP and TCP) and delegation checks against real servers on loopback.

Servers: an in-process region-agent (UDP and TCP), a UDP-only fake (:mod:`tests.fakes.dns_server`:
an asyncio datagram server answering SOA, no TCP listener), and PowerDNS (bind backend) as a stub
parent zone holding the delegation records :mod:`region_agent.globaldns.delegation` prints (marked ``external``).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import dns.flags
import dns.message
import dns.rcode
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from region_agent.globaldns.delegation import DelegationState, delegation_lines, expected_ns_names, name_servers
from region_agent.globaldns.reachability import (
    ReachabilityMonitor,
    ReachabilitySettings,
    TransportResult,
    _soa_problem,
    check_delegation,
    check_reachability,
    parse_endpoint,
)
from region_agent.state.model import Region
from tests.conftest import wait_for
from tests.fakes.dns_client import make_query
from tests.fakes.dns_server import UdpOnlySoa, soa_rrset, udp_only_soa
from tests.fakes.ports import free_port

# tests/app/test_geoip_status.py takes the agent's zone and the UDP-only server from here.
__all__ = ["AGENT_ZONE", "UdpOnlySoa"]

ZONE = "g.example.com"
AGENT_ZONE = ("regions:\n"
              "  sfo1: {ipv4: [127.0.0.51], ns_ipv4: [127.0.0.1]}\n"
              "  ams1: {ipv4: [127.0.0.52], ns_ipv4: [127.0.0.2]}\n"
              "projects: {shop: {regions: [sfo1, ams1]}}\n")


# --- pure parts ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "endpoint"), [
    ("192.0.2.53", ("192.0.2.53", 53)),
    ("192.0.2.53:5353", ("192.0.2.53", 5353)),
    ("2001:db8::53", ("2001:db8::53", 53)),
    ("[2001:db8::53]:5353", ("2001:db8::53", 5353)),
    ("[::1]", ("::1", 53)),
])
def test_endpoints(text: str, endpoint: tuple[str, int]) -> None:
    assert parse_endpoint(text) == endpoint


@pytest.mark.parametrize(("text", "message"), [
    ("resolver.example.net", "not an IP address"),
    ("192.0.2.53:0", "port must be 1..65535"),
    ("192.0.2.53:dns", "port must be 1..65535"),
    ("[2001:db8::53]5353", r"\[address\]:port"),
])
def test_bad_endpoints(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_endpoint(text)


def test_settings_are_validated_with_the_field_named() -> None:
    with pytest.raises(ValidationError, match=r"reachability\.resolver"):
        AgentSettings(reachability={"resolver": "resolver.example.net"})
    with pytest.raises(ValidationError, match=r"reachability\.public_addresses"):
        AgentSettings(reachability={"public_addresses": ["ns.example.net"]})
    with pytest.raises(ValidationError, match="must not exceed interval"):
        AgentSettings(reachability={"interval": 1, "timeout": 2})
    auto = ReachabilitySettings()
    assert (auto.active(kubernetes=True), auto.active(kubernetes=False)) == (True, False)
    assert ReachabilitySettings(enabled=False).active(kubernetes=True) is False


def _soa_response(zone: str = ZONE, *, rcode: dns.rcode.Rcode = dns.rcode.NOERROR, aa: bool = True,
                  owner: str | None = None) -> dns.message.Message:
    response = dns.message.make_response(make_query(zone, "SOA"))
    response.set_rcode(rcode)
    if aa:
        response.flags |= dns.flags.AA
    if rcode == dns.rcode.NOERROR:
        response.answer.append(soa_rrset(zone, owner))
    return response


@pytest.mark.parametrize(("response", "problem"), [
    (_soa_response(), ""),
    (_soa_response(rcode=dns.rcode.REFUSED), "answered REFUSED"),
    (_soa_response(aa=False), "answered without the authoritative (AA) flag"),
    (_soa_response(owner="other.example.com"), "answered without the zone's SOA"),
])
def test_what_counts_as_an_soa_answer(response: dns.message.Message, problem: str) -> None:
    assert _soa_problem(response, dns.name.from_text(ZONE)) == problem


# --- servers on loopback -------------------------------------------------------------


@pytest.fixture
async def udp_only() -> AsyncIterator[tuple[UdpOnlySoa, int]]:
    async with udp_only_soa(ZONE) as served:
        yield served


def _agent(tmp_path: Path, dns_port: int = 0, **reachability: object) -> Agent:
    zone = tmp_path / "zone.yaml"
    zone.write_text(AGENT_ZONE)
    return Agent(AgentSettings(region="sfo1", zone_file=zone, dns={"listen_addresses": ["127.0.0.1"], "port": dns_port},
                               health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0},
                               reachability=reachability))


async def test_a_region_agent_is_reachable_over_udp_and_tcp(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    await agent.start()
    try:
        port = agent.dns.server.bound[0][1]
        results = await check_reachability(["127.0.0.1"], ZONE, port=port, timeout=2)
        assert results == [TransportResult("127.0.0.1", "udp", True), TransportResult("127.0.0.1", "tcp", True)]
        # A zone the agent is not authoritative for: it answers REFUSED, which is not reachable.
        wrong = await check_reachability(["127.0.0.1"], "example.org", port=port, timeout=2)
        assert [(r.ok, r.error) for r in wrong] == [(False, "answered REFUSED")] * 2
    finally:
        await agent.stop()


async def test_the_agent_checks_its_own_name_server_and_exports_it(tmp_path: Path) -> None:
    dns_port = free_port()
    # No public_addresses: the agent asks its region's ns_ipv4 from the state (127.0.0.1).
    agent = _agent(tmp_path, dns_port, enabled=True, port=dns_port, interval=30, timeout=2)
    assert agent.reachability is not None
    await agent.start()
    try:
        def sample(transport: str) -> float | None:
            return agent.registry.get_sample_value("region_agent_dns_reachable", {"transport": transport})
        await wait_for(lambda: sample("udp") == 1 and sample("tcp") == 1, timeout=10, message="reachable both")
        assert agent.reachability.addresses() == ["127.0.0.1"]
        assert agent.problems() == ()
        last_success = agent.registry.get_sample_value("region_agent_dns_reachability_last_success_timestamp_seconds")
        assert last_success is not None and last_success > agent.views.started_at
    finally:
        await agent.stop()


async def test_udp_only_server_fails_tcp(udp_only: tuple[UdpOnlySoa, int]) -> None:
    server, port = udp_only
    udp, tcp = await check_reachability(["127.0.0.1"], ZONE, port=port, timeout=1)
    assert udp == TransportResult("127.0.0.1", "udp", True)
    assert tcp == TransportResult("127.0.0.1", "tcp", False, "ConnectionRefusedError: Connection refused")
    assert server.queries == 1


async def test_tcp_only_server_that_never_answers_fails_both() -> None:
    """A TCP listener that accepts and stays silent (a half-configured load balancer), nothing on UDP."""
    accepted = 0

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await reader.read()  # until the client gives up and closes
        writer.close()

    port = free_port()
    server = await asyncio.start_server(silent, "127.0.0.1", port)
    try:
        udp, tcp = await check_reachability(["127.0.0.1"], ZONE, port=port, timeout=0.3)
    finally:
        server.close()
        await server.wait_closed()
    assert tcp == TransportResult("127.0.0.1", "tcp", False, "no answer within 0.3 s")
    assert accepted == 1
    # Nothing listens on UDP: the port-unreachable comes back as refused, or the query times out.
    assert not udp.ok and udp.error in {"ConnectionRefusedError: Connection refused", "no answer within 0.3 s"}


async def test_a_failing_transport_degrades_the_agent_until_it_answers(
        tmp_path: Path, udp_only: tuple[UdpOnlySoa, int]) -> None:
    server, port = udp_only
    agent = _agent(tmp_path, enabled=True, public_addresses=["127.0.0.1"], port=port, interval=30, timeout=0.5)
    await agent.start()
    try:
        def sample(transport: str) -> float | None:
            return agent.registry.get_sample_value("region_agent_dns_reachable", {"transport": transport})
        await wait_for(lambda: sample("tcp") == 0, timeout=10, message="tcp unreachable")
        assert sample("udp") == 1
        problems = [p for p in agent.problems() if p.startswith("dns not reachable")]
        assert problems == [f"dns not reachable over tcp at 127.0.0.1:{port}: ConnectionRefusedError: "
                            "Connection refused"]
        failures = agent.registry.get_sample_value("region_agent_dns_reachability_failures_total", {"check": "tcp"})
        assert failures is not None and failures >= 1
        # A failed round is retried on a backoff (from the timeout), well before the 30 s interval.
        first = server.queries
        await wait_for(lambda: server.queries > first, timeout=10, message="a retry after the failure")
    finally:
        await agent.stop()


# --- delegation ----------------------------------------------------------------------


async def test_delegation_as_the_child_itself_answers_it(tmp_path: Path) -> None:
    """An authoritative NS answer (what a recursive resolver passes on) in the answer section."""
    agent = _agent(tmp_path)
    await agent.start()
    try:
        resolver = ("127.0.0.1", agent.dns.server.bound[0][1])
        expected = expected_ns_names(agent.store.regions.values(), ZONE)
        result = await check_delegation(resolver, ZONE, expected, timeout=2)
        assert result.state is DelegationState.OK
        assert result.seen == {"ns-sfo1.g.example.com", "ns-ams1.g.example.com"}
        more = await check_delegation(resolver, ZONE, {*expected, "ns-nrt1.g.example.com"}, timeout=2)
        assert more.state is DelegationState.PARTIAL
    finally:
        await agent.stop()


async def test_delegation_unknown_when_the_resolver_does_not_answer(udp_only: tuple[UdpOnlySoa, int]) -> None:
    _server, port = udp_only
    silent = free_port()  # nothing listens: the query times out or is refused
    result = await check_delegation(("127.0.0.1", silent), ZONE, {"ns-sfo1.g.example.com"}, timeout=0.3)
    assert result.state is DelegationState.UNKNOWN and "resolver 127.0.0.1:" in result.error
    # A server that answers NS queries with a SOA only (no NS anywhere): missing.
    answered = await check_delegation(("127.0.0.1", port), ZONE, {"ns-sfo1.g.example.com"}, timeout=1)
    assert (answered.state, answered.seen) == (DelegationState.MISSING, frozenset())


# PowerDNS as the parent zone (bench/common.py starts it the way the benches do).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

PARENT = "g.example.com"  # the zone bench/common.start_pdns serves; children are delegated below it
CHILD_REGIONS = [Region("sfo1", ns_ipv4=("127.0.0.1",)), Region("ams1", ns_ipv4=("127.0.0.2",), ns_ipv6=("::1",))]


def _parent_zone() -> str:
    def delegate(child: str, regions: list[Region]) -> list[str]:
        return delegation_lines(child, name_servers(regions, child), ttl=300)

    return "\n".join([
        f"$ORIGIN {PARENT}.",
        f"@ 3600 IN SOA ns.{PARENT}. hostmaster.{PARENT}. 1 3600 600 604800 60",
        f"@ 3600 IN NS ns.{PARENT}.",
        "ns 3600 IN A 127.0.0.1",
        *delegate(f"full.{PARENT}", CHILD_REGIONS),
        *delegate(f"half.{PARENT}", CHILD_REGIONS[:1]),
        f"moved.{PARENT}. 300 IN NS ns1.other-provider.net.",
    ]) + "\n"


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    if shutil.which("pdns_server") is None:
        pytest.skip("pdns_server not installed (apt-get install pdns-server pdns-backend-bind)")
    from common import start_pdns
    from dns_rig import Procs

    with Procs(tmp_path_factory.mktemp("pdns-parent")) as procs:  # stops PowerDNS by PID
        server = start_pdns(procs, "parent", _parent_zone())
        yield "127.0.0.1", server.port


@pytest.mark.external
@pytest.mark.parametrize(("child", "state", "seen"), [
    ("full", DelegationState.OK, {"ns-sfo1.full.g.example.com", "ns-ams1.full.g.example.com"}),
    ("half", DelegationState.PARTIAL, {"ns-sfo1.half.g.example.com"}),
    ("moved", DelegationState.MISSING, {"ns1.other-provider.net"}),
    ("absent", DelegationState.MISSING, set()),
])
async def test_delegation_in_a_powerdns_parent(parent: tuple[str, int], child: str, state: DelegationState,
                                               seen: set[str]) -> None:
    zone = f"{child}.{PARENT}"
    result = await check_delegation(parent, zone, expected_ns_names(CHILD_REGIONS, zone), timeout=2)
    assert (result.state, set(result.seen)) == (state, seen)


@pytest.mark.external
async def test_monitor_exports_the_delegation_state(parent: tuple[str, int]) -> None:
    registry = CollectorRegistry()
    address, port = parent
    zone = f"half.{PARENT}"
    monitor = ReachabilityMonitor(ReachabilitySettings(resolver=f"{address}:{port}", timeout=2),
                                  zone=zone, own_addresses=lambda: (),
                                  expected_ns=lambda: expected_ns_names(CHILD_REGIONS, zone), registry=registry)
    assert await monitor.check_once() is False
    states = {s: registry.get_sample_value("region_agent_dns_delegation", {"state": s})
              for s in ("ok", "partial", "missing", "unknown")}
    assert states == {"ok": 0, "partial": 1, "missing": 0, "unknown": 0}
    assert monitor.problems() == ()  # no transport checked (no addresses): a delegation is not an agent problem


async def test_a_round_without_addresses_checks_nothing_and_claims_nothing() -> None:
    registry = CollectorRegistry()
    known: list[str] = []
    monitor = ReachabilityMonitor(ReachabilitySettings(port=free_port(), timeout=0.3), zone=ZONE,
                                  own_addresses=lambda: known, expected_ns=lambda: (), registry=registry)
    assert await monitor.check_once() is True
    assert monitor.transports == [] and monitor.problems() == ()
    assert registry.get_sample_value("region_agent_dns_reachable", {"transport": "udp"}) is None
    assert registry.get_sample_value("region_agent_dns_reachability_last_success_timestamp_seconds") == 0  # never
    known.append("127.0.0.1")  # the region's name-server address arrives in the state: the next round asks it
    assert await monitor.check_once() is False
    assert [r.transport for r in monitor.transports if not r.ok] == ["udp", "tcp"]
    assert registry.get_sample_value("region_agent_dns_reachable", {"transport": "tcp"}) == 0
