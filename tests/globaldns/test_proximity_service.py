"""Proximity answers through the real server with a MaxMind-format database on disk."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path

import dns.edns
import pytest
from prometheus_client import CollectorRegistry

from region_agent.demo.mmdb_writer import MmdbWriter, city_record
from region_agent.globaldns.service import ZoneService
from region_agent.globaldns.settings import DnsSettings
from region_agent.state.model import CopyHealth, copy_key, project_key
from tests.conftest import wait_for
from tests.fakes.dns_client import ask, make_query, rdata_texts
from tests.globaldns.zones import ALL, proximity, store_with, up

# Client networks and where the database puts them.
EUROPE = "203.0.113.0/24"  # Amsterdam: closest ams1
AMERICA = "198.51.100.0/24"  # San Jose: closest sfo1
ASIA = "192.0.2.128/25"  # Osaka: closest nrt1


def _database(path: Path) -> Path:
    writer = MmdbWriter(ip_version=6)
    writer.insert(EUROPE, city_record("Amsterdam", 52.37, 4.90))
    writer.insert(AMERICA, city_record("San Jose", 37.34, -121.89))
    writer.insert(ASIA, city_record("Osaka", 34.69, 135.50))
    writer.insert("192.0.2.0/25", city_record("Nowhere", None, None))
    path.write_bytes(writer.to_bytes())
    return path


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[ZoneService]:
    store = store_with([proximity("blog")], {("blog", r): up(r)[r] for r in ALL})
    settings = DnsSettings(zone="g.example.com", listen_addresses=("127.0.0.1",), port=0,
                           geoip_database=_database(tmp_path / "city.mmdb"))
    zone = ZoneService(settings, store, CollectorRegistry())
    zone.set_health_known()  # health is given here, not checked
    await zone.start()
    yield zone
    await zone.stop()


async def _ask(zone: ZoneService, subnet: str) -> tuple[set[str], int]:
    network = ipaddress.ip_network(subnet)
    query = make_query("blog.g.example.com", ecs=(str(network.network_address), network.prefixlen))
    response = await ask(zone.server.bound[0][1], query)
    (ecs,) = [o for o in response.options if isinstance(o, dns.edns.ECSOption)]
    return rdata_texts(response), ecs.scopelen


@pytest.mark.parametrize(("subnet", "expected"), [
    (EUROPE, {"192.0.2.12"}),
    (AMERICA, {"192.0.2.11"}),
    (ASIA, {"192.0.2.13"}),
    ("192.0.2.0/25", {"192.0.2.11", "192.0.2.12", "192.0.2.13"}),  # in the database, no location
])
async def test_closest_region_by_ecs(service: ZoneService, subnet: str, expected: set[str]) -> None:
    answer, scope = await _ask(service, subnet)
    assert answer == expected
    assert 0 < scope <= 32


async def test_scope_holds_for_the_whole_network(service: ZoneService) -> None:
    answer, scope = await _ask(service, EUROPE)
    wider = ipaddress.ip_network(EUROPE).supernet(new_prefix=scope)
    for probe in (wider.network_address, wider.broadcast_address):
        again, _ = await _ask(service, f"{probe}/32")
        assert again == answer


async def test_a_failed_region_moves_its_clients_to_the_next_closest(service: ZoneService) -> None:
    service.store.put(copy_key("blog", "ams1"), CopyHealth(False, "down"))
    assert await wait_for(lambda: _answer_is(service, EUROPE, {"192.0.2.11"}), timeout=3,
                          message="Europe moves to sfo1")
    service.store.delete(project_key("blog"))


async def _answer_is(zone: ZoneService, subnet: str, expected: set[str]) -> bool:
    return (await _ask(zone, subnet))[0] == expected
