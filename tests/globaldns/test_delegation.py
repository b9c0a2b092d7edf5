"""The delegation records (pure) and ``region-agent zone --delegation`` against a running agent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import dns.zone
import pytest

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from region_agent.cli.main import main
from region_agent.globaldns.delegation import (
    DelegationState,
    NameServer,
    delegation_lines,
    delegation_state,
    expected_ns_names,
    name_servers,
    name_servers_from_zone_document,
)
from region_agent.state.model import Region

REGIONS = [
    Region("sfo1", ipv4=("203.0.113.10",), ns_ipv4=("203.0.113.53",), ns_ipv6=("2001:db8::53",)),
    Region("ams1", ipv4=("198.51.100.10",), ns_ipv4=("198.51.100.53",)),
    Region("nrt1", ipv4=("192.0.2.10",)),  # no name-server address: not delegated to
]


def test_one_name_server_per_region_with_a_name_server_address() -> None:
    assert name_servers(REGIONS, "G.Example.com.") == [
        NameServer("ns-ams1.g.example.com", ("198.51.100.53",)),
        NameServer("ns-sfo1.g.example.com", ("203.0.113.53",), ("2001:db8::53",)),
    ]
    assert expected_ns_names(REGIONS, "g.example.com") == {"ns-ams1.g.example.com", "ns-sfo1.g.example.com"}


def test_lines_are_a_zone_file_of_ns_and_glue() -> None:
    lines = delegation_lines("g.example.com", name_servers(REGIONS, "g.example.com"), ttl=600)
    assert lines == [
        "g.example.com.\t600\tIN\tNS\tns-ams1.g.example.com.",
        "g.example.com.\t600\tIN\tNS\tns-sfo1.g.example.com.",
        "ns-ams1.g.example.com.\t600\tIN\tA\t198.51.100.53",
        "ns-sfo1.g.example.com.\t600\tIN\tA\t203.0.113.53",
        "ns-sfo1.g.example.com.\t600\tIN\tAAAA\t2001:db8::53",
    ]
    # What a DNS server reads from them (dnspython's zone-file parser, as the parent's operator would load them).
    parent = dns.zone.from_text("\n".join(["@ 600 IN SOA ns.example.com. h.example.com. 1 2 3 4 5",
                                           "@ 600 IN NS ns.example.com.", *lines]),
                                origin="example.com.", relativize=False, check_origin=True)
    ns = parent.get_rdataset("g.example.com.", "NS")
    assert ns is not None and {r.target.to_text() for r in ns} == {"ns-ams1.g.example.com.",
                                                                     "ns-sfo1.g.example.com."}
    aaaa = parent.get_rdataset("ns-sfo1.g.example.com.", "AAAA")
    assert aaaa is not None and [r.address for r in aaaa] == ["2001:db8::53"]


@pytest.mark.parametrize(("expected", "seen", "state"), [
    ({"ns-sfo1.g.example.com", "ns-ams1.g.example.com"}, {"ns-sfo1.g.example.com.", "NS-AMS1.g.example.com."},
     DelegationState.OK),
    ({"ns-sfo1.g.example.com"}, {"ns-sfo1.g.example.com", "ns.old-provider.net"}, DelegationState.OK),
    ({"ns-sfo1.g.example.com", "ns-ams1.g.example.com"}, {"ns-sfo1.g.example.com"}, DelegationState.PARTIAL),
    ({"ns-sfo1.g.example.com", "ns-ams1.g.example.com"}, {"ns-sfo1.g.example.com", "ns.old-provider.net"},
     DelegationState.PARTIAL),
    ({"ns-sfo1.g.example.com"}, {"ns.old-provider.net"}, DelegationState.MISSING),
    ({"ns-sfo1.g.example.com"}, set(), DelegationState.MISSING),
    (set(), {"ns-sfo1.g.example.com"}, DelegationState.MISSING),
])
def test_delegation_state(expected: set[str], seen: set[str], state: DelegationState) -> None:
    assert delegation_state(expected, seen) is state


def test_zone_document_gives_the_name_servers() -> None:
    document: dict[str, Any] = {"zone": "g.example.com", "records": [
        {"name": "g.example.com", "type": "SOA", "serial": 1, "mname": "ns-ams1.g.example.com"},
        {"name": "ns-sfo1.g.example.com", "type": "NS glue", "addresses": ["203.0.113.53", "2001:db8::53"]},
        {"name": "shop.g.example.com", "type": "project", "mode": "ha"},
        {"name": "ns-ams1.g.example.com", "type": "NS glue", "addresses": ["198.51.100.53"]},
    ]}
    assert name_servers_from_zone_document(document) == ("g.example.com", name_servers(REGIONS, "g.example.com"))
    with pytest.raises(ValueError, match="names no zone"):
        name_servers_from_zone_document({"records": []})


async def test_cli_prints_the_delegation_of_a_running_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_text("regions:\n"
                    "  sfo1: {ipv4: [127.0.0.51], ns_ipv4: [127.0.0.53], ns_ipv6: ['::1']}\n"
                    "  ams1: {ipv4: [127.0.0.52], ns_ipv4: [127.0.0.54]}\n"
                    "  nrt1: {ipv4: [127.0.0.55]}\n"
                    "projects: {shop: {regions: [sfo1, ams1]}}\n")
    agent = Agent(AgentSettings(region="sfo1", zone_file=zone, dns={"listen_addresses": ["127.0.0.1"], "port": 0},
                                health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    await agent.start()
    try:
        url = "http://{}:{}".format(*agent.health.operator.addresses[0])
        code = await asyncio.to_thread(main, ["zone", "--url", url, "--delegation", "--ttl", "300"])
    finally:
        await agent.stop()
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out == [
        "; the delegation of g.example.com: records to create in its parent zone",
        "g.example.com.\t300\tIN\tNS\tns-ams1.g.example.com.",
        "g.example.com.\t300\tIN\tNS\tns-sfo1.g.example.com.",
        "ns-ams1.g.example.com.\t300\tIN\tA\t127.0.0.54",
        "ns-sfo1.g.example.com.\t300\tIN\tA\t127.0.0.53",
        "ns-sfo1.g.example.com.\t300\tIN\tAAAA\t::1",
    ]


async def test_cli_delegation_without_name_servers_fails_clearly(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_text("regions: {sfo1: {ipv4: [127.0.0.51]}}\nprojects: {}\n")
    agent = Agent(AgentSettings(region="sfo1", zone_file=zone, dns={"listen_addresses": ["127.0.0.1"], "port": 0},
                                health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    await agent.start()
    try:
        url = "http://{}:{}".format(*agent.health.operator.addresses[0])
        code = await asyncio.to_thread(main, ["zone", "--url", url, "--delegation"])
    finally:
        await agent.stop()
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert "no region of g.example.com has a name-server address" in captured.err
