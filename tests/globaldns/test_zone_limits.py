"""The zone's limits: its own length, the TTLs, and a compilation that can never take the zone down.

A name that is not a DNS name is left out and reported (every entrance refuses such names; the
compiler must not fail on one that got in anyway), and a compilation that raises for any reason
leaves the previous tables answering while the agent is degraded with the reason.
"""

from __future__ import annotations

import time
from typing import Any

import dns.message
import dns.rdatatype
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from region_agent.globaldns import service as zone_service
from region_agent.globaldns.compiler import CompileReport, ZoneBuild, ZoneConfig, compile_zone
from region_agent.globaldns.service import ZoneService
from region_agent.globaldns.settings import MAX_ZONE_CHARACTERS, DnsSettings
from region_agent.globaldns.wire import name_from_text
from region_agent.state.hlc import HybridClock
from region_agent.state.model import Project, Region, project_key, region_key
from region_agent.state.store import Store

LONGEST_REGION = "abc" + "1" * 57   # ns-<region>: a label of 63 octets
LONGEST_SLUG = "s" * 63
LONGEST_ZONE = ".".join(["z" * 63, "y" * 63, "x" * 61])   # 189 characters: 191 octets


def _store(*items: tuple[Any, Any]) -> Store:
    store = Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    store.put_many(list(items))
    return store


def test_the_longest_zone_holds_the_longest_names_one_label_below_it() -> None:
    assert len(LONGEST_ZONE) == MAX_ZONE_CHARACTERS
    zone = DnsSettings(zone=LONGEST_ZONE).zone
    store = _store((region_key(LONGEST_REGION), Region(LONGEST_REGION, ipv4=("192.0.2.1",), ns_ipv4=("192.0.2.53",))),
                   (project_key(LONGEST_SLUG), Project(LONGEST_SLUG, (LONGEST_REGION,))))
    report = CompileReport()
    tables = compile_zone(store, ZoneConfig(zone), report=report)
    assert report.problems == []
    assert len(name_from_text(f"ns-{LONGEST_REGION}.{zone}")) == 255
    assert name_from_text(f"{LONGEST_SLUG}.{zone}") in tables.nodes


@pytest.mark.parametrize(("field", "value", "message"), [
    ("zone", LONGEST_ZONE + "w", "at most 189"),
    ("zone", "x" * 64 + ".com", "not a DNS name"),
    ("soa_mname", "ns." + "x" * 64 + ".com", "not a DNS name"),
    ("hostmaster", "hostmaster." + ("x" * 63 + ".") * 4 + "com", "not a DNS name"),
    ("record_ttl", 0, "greater than or equal to 1"),
    ("record_ttl", 2**31 - 1, "less than or equal to 86400"),
    ("ns_ttl", 604_801, "less than or equal to 604800"),
    ("soa_ttl", 0, "greater than or equal to 1"),
    ("soa_minimum", 86_401, "less than or equal to 86400"),
    ("soa_refresh", 2**32, "less than or equal to 604800"),
    ("soa_retry", 0, "greater than or equal to 1"),
    ("soa_expire", 2**31 - 1, "less than or equal to 3628800"),
])
def test_settings_outside_the_limits_are_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as caught:
        DnsSettings(**{field: value})
    assert caught.value.errors()[0]["loc"] == (field,)


def test_the_limits_take_their_ends() -> None:
    settings = DnsSettings(record_ttl=86_400, ns_ttl=604_800, soa_ttl=1, soa_minimum=0, soa_expire=3_628_800,
                           soa_mname="NS1.Example.NET.", hostmaster="hostmaster.example.net")
    assert (settings.record_ttl, settings.soa_mname) == (86_400, "ns1.example.net")


def test_a_name_that_is_not_a_dns_name_is_left_out_and_reported_not_raised() -> None:
    # ZoneConfig is not validated like the settings: an apex too long for ns-<region> below it.
    apex = ".".join(["z" * 63, "y" * 63, "x" * 63])
    store = _store((region_key(LONGEST_REGION), Region(LONGEST_REGION, ipv4=("192.0.2.1",), ns_ipv4=("192.0.2.53",))),
                   (region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.2",), ns_ipv4=("192.0.2.54",))),
                   (project_key(LONGEST_SLUG), Project(LONGEST_SLUG, ("sfo1",))),
                   (project_key("shop"), Project("shop", ("sfo1",))))
    report = CompileReport()
    tables = compile_zone(store, ZoneConfig(apex), report=report)
    assert [line.split(":")[0] for line in report.left_out] == [f"region {LONGEST_REGION}", f"project {LONGEST_SLUG}"]
    assert set(report.left_out) <= set(report.problems)
    assert set(tables.projects) == {"shop"}
    assert name_from_text(f"ns-sfo1.{apex}") in tables.nodes


def _a_answer(service: ZoneService, name: str) -> set[str]:
    query = dns.message.make_query(name, "A")
    raw = service.responder.respond(query.to_wire(), "192.0.2.99", tcp=False)
    assert raw is not None
    return {rr.address for rrset in dns.message.from_wire(raw).answer if rrset.rdtype == dns.rdatatype.A
            for rr in rrset}


async def test_a_compile_that_raises_is_a_problem_while_the_previous_tables_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store((region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",), ns_ipv4=("192.0.2.53",))),
                   (project_key("shop"), Project("shop", ("sfo1",))))
    registry = CollectorRegistry()
    service = ZoneService(DnsSettings(zone="g.example.com", port=0), store, registry)
    service.rebuild()
    service.set_health_known()
    await service.compiled()
    before = service.tables
    assert service.problems() == () and _a_answer(service, "shop.g.example.com.") == {"192.0.2.1"}

    def failing_build(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom in the compiler")

    monkeypatch.setattr(zone_service, "ZoneBuild", failing_build)
    store.put(region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.7",), ns_ipv4=("192.0.2.53",)))
    await service.compiled()   # returns: the failure is the service's, not an exception of its task
    assert service.tables is before
    assert service.problems() == (
        "zone compile failed, answering the previous zone: RuntimeError: boom in the compiler",)
    assert _a_answer(service, "shop.g.example.com.") == {"192.0.2.1"}
    assert registry.get_sample_value("region_agent_dns_zone_errors_total") == 1

    monkeypatch.setattr(zone_service, "ZoneBuild", ZoneBuild)
    store.put(project_key("blog"), Project("blog", ("sfo1",)))   # the next change compiles everything
    await service.compiled()
    assert service.problems() == ()
    assert _a_answer(service, "shop.g.example.com.") == {"192.0.2.7"}
    assert _a_answer(service, "blog.g.example.com.") == {"192.0.2.7"}


def test_a_first_compile_that_raises_is_a_problem_not_a_failed_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("bad entry")

    monkeypatch.setattr(zone_service, "compile_zone", failing)
    service = ZoneService(DnsSettings(zone="g.example.com", port=0), _store(), CollectorRegistry())
    service.rebuild()
    assert service.tables is None
    assert service.problems() == (
        "zone compile failed, answering SERVFAIL (no zone compiled yet): ValueError: bad entry",)
