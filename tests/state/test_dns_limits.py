"""A peer's entry the zone could not hold is refused when it is decoded, counted, and changes nothing.

Region names become ``ns-<region>.<zone>`` (one label: at most 60 characters), addresses are answered to
clients (unicast only), challenge names are DNS names; the zone itself is bounded in the settings so
that any name one label below it fits in 255 octets (``tests/globaldns/test_zone_limits.py``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from region_agent.app.replication import StoreReplica, encode_entry
from region_agent.base.clock import ManualClock
from region_agent.state.hlc import HybridClock
from region_agent.state.model import SCHEMA_VERSION, Challenge, ModelError, Region, dns_name_problem, region_key
from region_agent.state.store import Entry, Store, Version, entry_from_json

LONGEST_REGION = "abc" + "1" * 57   # 60 characters: ns-<region> is 63 octets
WALL_MS = ManualClock().wall_ms()


def _raw_region(name: str, **fields: Any) -> dict[str, object]:
    value = {"name": name, "ipv4": [], "ipv6": [], "ns_ipv4": [], "ns_ipv6": [], "latitude": None, "longitude": None,
             "witness": False, **fields}
    return {"v": SCHEMA_VERSION, "key": ["region", name], "value": value, "hlc": WALL_MS << 16,
            "writer": "control/ams1.n2", "signer": "", "sig": ""}


BAD_REGIONS = {
    "61-character name": _raw_region(LONGEST_REGION + "1"),
    "unspecified ingress": _raw_region("lax1", ipv4=["0.0.0.0"]),
    "multicast ingress": _raw_region("lax1", ipv6=["ff02::1"]),
    "multicast name server": _raw_region("lax1", ns_ipv4=["224.0.0.251"]),
    "broadcast name server": _raw_region("lax1", ns_ipv4=["255.255.255.255"]),
    "link-local ingress": _raw_region("lax1", ipv6=["fe80::1"]),
}


@pytest.mark.parametrize("raw", BAD_REGIONS.values(), ids=BAD_REGIONS.keys())
def test_a_region_the_zone_can_not_hold_does_not_decode(raw: dict[str, object]) -> None:
    with pytest.raises(ModelError):
        entry_from_json(raw)


def test_the_longest_region_and_loopback_addresses_decode() -> None:
    entry = entry_from_json(_raw_region(LONGEST_REGION, ipv4=["127.0.0.2"], ns_ipv6=["::1"]))
    assert isinstance(entry.value, Region) and entry.value.ipv4 == ("127.0.0.2",)


async def test_a_peer_batch_with_bad_regions_applies_only_the_good_one_and_counts_the_rest() -> None:
    registry = CollectorRegistry()
    store = Store(writer="sfo1/n1", clock=HybridClock(ManualClock().wall_ms), registry=registry)
    replica = StoreReplica(store, registry)
    good = Entry(region_key("ams1"), Region("ams1", ipv4=("198.51.100.1",)), Version(WALL_MS << 16, "control/ams1.n2"))
    batch = [json.dumps(raw).encode() for raw in BAD_REGIONS.values()] + [encode_entry(good)]
    assert await replica.merge(batch, "ams1-n2") == 1
    assert set(store.regions) == {"ams1"}
    assert registry.get_sample_value("region_agent_gossip_store_undecodable_total") == len(BAD_REGIONS)


@pytest.mark.parametrize("name", [
    "_acme-challenge." + "x" * 64 + ".g.example.com.",       # a label of 64 octets
    "_acme-challenge." + ("a" * 62 + ".") * 3 + "b" * 35 + ".g.example.com.",   # 256 octets in wire form
], ids=["long label", "long name"])
def test_a_challenge_name_that_is_not_a_dns_name_is_refused(name: str) -> None:
    assert dns_name_problem(name) is not None
    with pytest.raises(ModelError, match="not a DNS name"):
        Challenge(name, b"\x05token", 60, 0)


def test_a_challenge_name_of_255_octets_is_one() -> None:
    name = "_acme-challenge." + ("a" * 62 + ".") * 3 + "b" * 34 + ".g.example.com."   # 255 octets
    assert dns_name_problem(name) is None
    assert Challenge(name, b"\x05token", 60, 0).name == name
