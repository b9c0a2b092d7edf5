"""Proximity selection and ECS scopes, checked against a brute-force oracle.

The oracle shares no code with ``region_agent.globaldns.geoip.proximity``: it reads the files with the ``maxminddb``
reader, measures great-circle distance with its own formula (atan2 of cross and dot products of
unit vectors), and proves a scope by enumerating every leaf network inside it (and finding a
different answer inside the network one bit wider).
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path

import maxminddb
import maxminddb.reader
import pytest

from region_agent.demo.mmdb_writer import MmdbWriter, city_record
from region_agent.globaldns.geoip.proximity import GeoDatabase, GeoDatabaseError, ProximityMap, Site, haversine_km

Address = IPv4Address | IPv6Address

SITES = (
    Site("sfo1", 37.62, -122.38),
    Site("iad1", 38.95, -77.45),
    Site("ams1", 52.31, 4.76),
    Site("nrt1", 35.77, 140.39),
    Site("syd1", -33.95, 151.18),
    Site("gru1", -23.43, -46.47),
)
ALL = frozenset(site.name for site in SITES)
MAPPED_FIRST = 0xFFFF << 32
MAPPED_LAST = MAPPED_FIRST | 0xFFFFFFFF

# --------------------------------------------------------------------------------------------
# The oracle


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    def unit(lat: float, lon: float) -> tuple[float, float, float]:
        phi, lam = math.radians(lat), math.radians(lon)
        return (math.cos(phi) * math.cos(lam), math.cos(phi) * math.sin(lam), math.sin(phi))

    ax, ay, az = unit(lat1, lon1)
    bx, by, bz = unit(lat2, lon2)
    cross = math.sqrt((ay * bz - az * by) ** 2 + (az * bx - ax * bz) ** 2 + (ax * by - ay * bx) ** 2)
    return 6371.0088 * math.atan2(cross, ax * bx + ay * by + az * bz)


def closest(latitude: float, longitude: float, sites: tuple[Site, ...], names: frozenset[str]) -> list[str]:
    chosen = [site for site in sites if site.name in names]
    chosen.sort(key=lambda s: (great_circle_km(latitude, longitude, s.latitude, s.longitude), s.name))
    return [site.name for site in chosen]


def coordinates(record: object) -> tuple[float, float] | None:
    if not isinstance(record, dict):
        return None
    location = record.get("location")
    if not isinstance(location, dict):
        return None
    lat, lon = location.get("latitude"), location.get("longitude")
    if not isinstance(lat, float) or not isinstance(lon, float):
        return None
    if not (math.isfinite(lat) and math.isfinite(lon) and abs(lat) <= 90 and abs(lon) <= 180):
        return None
    return lat, lon


class TolerantReader(maxminddb.reader.Reader):
    """maxminddb's pure-Python reader, answering None for a record that does not decode."""

    def _resolve_data_pointer(self, pointer: int) -> object:
        try:
            return super()._resolve_data_pointer(pointer)
        except maxminddb.InvalidDatabaseError:
            return None


@dataclass
class Oracle:
    reader: maxminddb.Reader
    tolerant: TolerantReader
    sites: tuple[Site, ...]

    @classmethod
    def open(cls, path: Path, sites: tuple[Site, ...] = SITES) -> Oracle:
        return cls(maxminddb.open_database(str(path)), TolerantReader(str(path)), sites)

    def lookup(self, address: Address) -> tuple[object, int]:
        try:
            return self.reader.get_with_prefix_len(address)
        except maxminddb.InvalidDatabaseError:
            return self.tolerant.get_with_prefix_len(address)

    def record(self, value: int, version: int) -> tuple[object, int]:
        """(record, last address of the range around ``value`` that has this same record)."""
        ip_version = self.reader.metadata().ip_version
        if version == 4:
            record, length = self.lookup(IPv4Address(value))
            return record, value | ((1 << (32 - length)) - 1)
        if MAPPED_FIRST <= value <= MAPPED_LAST:  # located as IPv4, whatever the tree says
            record, length = self.lookup(IPv4Address(value & 0xFFFFFFFF))
            return record, value | ((1 << (32 - length)) - 1)
        if ip_version == 4:
            record, last = None, (1 << 128) - 1
        else:
            record, length = self.lookup(IPv6Address(value))
            last = value | ((1 << (128 - length)) - 1)
        if value < MAPPED_FIRST <= last:
            last = MAPPED_FIRST - 1
        return record, last

    def answer(self, record: object, names: frozenset[str], rank: bool) -> object:
        known = names & {site.name for site in self.sites}
        if len(known) == 1:
            return next(iter(known)) if not rank else (next(iter(known)),)
        if not known:
            return None
        where = coordinates(record)
        if where is None:
            return None
        order = closest(where[0], where[1], self.sites, known)
        return tuple(order) if rank else order[0]

    def answer_at(self, address: Address, names: frozenset[str], rank: bool = False) -> object:
        return self.answer(self.record(int(address), address.version)[0], names, rank)

    def answers_in(self, network: IPv4Network | IPv6Network, names: frozenset[str], rank: bool = False) -> set[object]:
        """Every answer given inside ``network``; stops once two are found."""
        found: set[object] = set()
        value = int(network.network_address)
        last = int(network.broadcast_address)
        while value <= last and len(found) < 2:
            record, end = self.record(value, network.version)
            found.add(self.answer(record, names, rank))
            value = end + 1
        return found


def mapped_floor(address: IPv6Address) -> int:
    differing = (int(address) >> 32) ^ 0xFFFF
    return 97 - differing.bit_length()


def assert_exact(
    pmap: ProximityMap,
    oracle: Oracle,
    address: Address,
    names: frozenset[str],
    *,
    rank: bool = False,
    floor: int = 0,
) -> int:
    """The answer is the oracle's, every address of the scope gets it, one bit wider does not."""
    result, scope = pmap.rank(address, names) if rank else pmap.choose(address, names)
    expected = oracle.answer_at(address, names, rank)
    assert result == expected, (address, sorted(names), scope)
    network = ipaddress.ip_network((address, scope), strict=False)
    assert oracle.answers_in(network, names, rank) == {expected}, (address, sorted(names), scope)
    mapped_boundary = address.version == 6 and MAPPED_FIRST <= int(address) <= MAPPED_LAST and scope == 96
    if scope > floor and not mapped_boundary:
        wider = ipaddress.ip_network((address, scope - 1), strict=False)
        assert len(oracle.answers_in(wider, names, rank)) == 2, (address, sorted(names), scope, "not widest")
    return scope


def subsets(names: frozenset[str], smallest: int = 2) -> Iterator[frozenset[str]]:
    ordered = sorted(names)
    for size in range(smallest, len(ordered) + 1):
        for combo in itertools.combinations(ordered, size):
            yield frozenset(combo)


# --------------------------------------------------------------------------------------------
# Hand-made databases

WORLD_V4 = [
    ("1.0.0.0/8", city_record("Amsterdam", 52.37, 4.90)),
    ("1.2.0.0/16", city_record("Tokyo", 35.68, 139.69)),
    ("1.2.3.0/24", city_record("Sydney", -33.87, 151.21)),
    ("1.2.3.128/25", city_record("Paris", 48.85, 2.35)),
    ("2.0.0.0/7", city_record("London", 51.51, -0.13)),
    ("4.0.0.0/6", city_record("New York", 40.71, -74.01)),
    ("8.0.0.0/8", city_record("San Jose", 37.34, -121.89)),
    ("8.8.0.0/16", {"country": {"iso_code": "US"}}),  # a country-only record: no location
    ("10.0.0.0/8", city_record("Reykjavik", 64.15, -21.94)),
    ("11.0.0.0/8", city_record("Nowhere", 95.0, 10.0)),  # latitude out of range
    ("13.0.0.0/9", city_record("Haarlem", 52.38, 4.64)),
    ("13.128.0.0/9", city_record("Haarlem-2", 52.38, 4.64)),  # another record, same place
    ("14.0.0.0/9", city_record("Helsinki", 60.17, 24.94)),
    ("14.128.0.0/9", city_record("Dakar", 14.72, -17.47)),
    ("15.0.0.0/8", city_record("Lima", -12.05, -77.04)),
    ("16.0.0.0/8", city_record("Anchorage", 61.22, -149.90)),
    ("17.0.0.0/8", city_record("Honolulu", 21.31, -157.86)),
    ("18.0.0.0/8", city_record("Suva", -18.14, 178.44)),
    ("19.0.0.0/8", city_record("Cape Town", -33.92, 18.42)),
    ("23.1.2.0/24", city_record("Half", 40.0, -30.0)),
    ("23.1.2.64/26", city_record("Quarter", 40.0, -29.0)),
]
WORLD_V6 = [
    ("2001:db8::/32", city_record("Tokyo", 35.68, 139.69)),
    ("2001:db8:1::/48", city_record("Sydney", -33.87, 151.21)),
    ("2a00::/12", city_record("Amsterdam", 52.37, 4.90)),
    ("2a00:1::/32", city_record("Sao Paulo", -23.55, -46.63)),
    ("2600::/12", city_record("New York", 40.71, -74.01)),
    ("2600:1::/32", {"country": {"iso_code": "US"}}),
    ("2c00::/12", city_record("Johannesburg", -26.20, 28.05)),
]


def world_writer(*, ip_version: int = 6, record_size: int = 28, alias_ipv4: bool = True) -> MmdbWriter:
    writer = MmdbWriter(ip_version=ip_version, record_size=record_size, alias_ipv4=alias_ipv4)
    for network, record in WORLD_V4:
        writer.insert(network, record)
    writer.insert_raw("12.0.0.0/8", b"\xe3\xff\xff\xff\xff")  # a map whose keys are garbage
    if ip_version == 6:
        for network, record in WORLD_V6:
            writer.insert(network, record)
    return writer


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("geo") / "world.mmdb"
    world_writer().write(path)
    return path


@pytest.fixture(scope="module")
def world_db(world: Path) -> GeoDatabase:
    return GeoDatabase.open(world)


@pytest.fixture(scope="module")
def oracle(world: Path) -> Oracle:
    return Oracle.open(world)


def probe_addresses(networks: list[str]) -> list[Address]:
    """First, last and a middle address of every network, and a few seeded random ones."""
    out: list[Address] = []
    for text in networks:
        net = ipaddress.ip_network(text)
        size = net.num_addresses
        out += [net.network_address, net.broadcast_address, net.network_address + size // 3]
    return out


V4_PROBES = probe_addresses([n for n, _ in WORLD_V4] + ["12.0.0.0/8", "0.0.0.0/8", "200.0.0.0/8"])
V6_PROBES = probe_addresses([n for n, _ in WORLD_V6] + ["2400::/12", "::/120"])
RANDOM = random.Random(7)
V4_PROBES += [IPv4Address(RANDOM.getrandbits(32)) for _ in range(20)]
V6_PROBES += [IPv6Address((0x2 << 124) | RANDOM.getrandbits(124)) for _ in range(20)]


# --------------------------------------------------------------------------------------------
# The writer makes valid files


@pytest.mark.parametrize("record_size", [24, 28, 32])
@pytest.mark.parametrize("ip_version", [4, 6])
@pytest.mark.parametrize("mode", [maxminddb.MODE_MMAP_EXT, maxminddb.MODE_MMAP])
def test_writer_output_opens_in_maxminddb(tmp_path: Path, record_size: int, ip_version: int, mode: int) -> None:
    path = tmp_path / "w.mmdb"
    world_writer(ip_version=ip_version, record_size=record_size).write(path)
    with maxminddb.open_database(str(path), mode) as reader:
        meta = reader.metadata()
        assert (meta.ip_version, meta.record_size, meta.database_type) == (ip_version, record_size, "Test-City")
        record, length = reader.get_with_prefix_len("1.2.3.200")
        assert record is not None and length == 25
        assert record["city"]["names"]["en"] == "Paris"  # type: ignore[index, call-overload]
        assert reader.get("1.2.3.4")["location"]["latitude"] == -33.87  # type: ignore[index, call-overload]
        assert reader.get("200.1.1.1") is None
        if ip_version == 6:
            assert reader.get("::ffff:1.2.3.4") == reader.get("1.2.3.4")  # the alias
            assert reader.get("2002:0102:0304::1") == reader.get("1.2.3.4")  # 6to4 alias
            assert reader.get("2001:db8:1:2::3")["city"]["names"]["en"] == "Sydney"  # type: ignore[index, call-overload]


# --------------------------------------------------------------------------------------------
# Distance and the closest site


@pytest.mark.parametrize(
    ("a", "b", "km"),
    [
        ((37.62, -122.38), (40.64, -73.78), 4152),  # SFO - JFK
        ((51.47, -0.45), (40.64, -73.78), 5540),  # LHR - JFK
        ((0.0, 179.5), (0.0, -179.5), 111),  # across the date line: 1 degree, not 359
        ((89.5, 0.0), (89.5, 180.0), 111),  # across the pole
        ((-33.95, 151.18), (-33.95, 151.18), 0),
        ((0.0, 0.0), (0.0, 180.0), 20015),  # antipodes
    ],
)
def test_haversine(a: tuple[float, float], b: tuple[float, float], km: float) -> None:
    assert haversine_km(*a, *b) == pytest.approx(km, abs=3)
    assert haversine_km(*a, *b) == pytest.approx(great_circle_km(*a, *b), abs=1e-6)


@pytest.mark.parametrize(
    ("where", "sites", "expected"),
    [
        # date line: 1.5 degrees east across it beats 4 degrees west (flat degrees say 357 vs 4)
        ((0.0, 179.0), (Site("east1", 0.0, -179.5), Site("west1", 0.0, 175.0)), "east1"),
        ((-18.1, 178.4), (Site("suv1", -17.0, -179.9), Site("nan1", -17.8, 170.0)), "suv1"),
        # near the pole: over the top (4 degrees) beats down the same meridian (8 degrees)
        ((88.0, 10.0), (Site("top1", 88.0, -170.0), Site("low1", 80.0, 10.0)), "top1"),
        ((-89.0, 0.0), (Site("pol1", -89.0, 120.0), Site("aus1", -80.0, 0.0)), "pol1"),
        # at high latitude a degree of longitude is short: 30 degrees east beats 12 degrees south
        ((70.0, 0.0), (Site("eas1", 70.0, 30.0), Site("sou1", 58.0, 0.0)), "eas1"),
        # a tie goes to the smaller name
        ((0.0, 0.0), (Site("bbb1", 10.0, 0.0), Site("aaa1", -10.0, 0.0)), "aaa1"),
    ],
)
def test_closest_site_table(tmp_path: Path, where: tuple[float, float], sites: tuple[Site, ...], expected: str) -> None:
    writer = MmdbWriter()
    writer.insert("20.0.0.0/8", city_record("x", *where))
    writer.write(tmp_path / "one.mmdb")
    pmap = ProximityMap(GeoDatabase.open(tmp_path / "one.mmdb"), sites)
    names = frozenset(site.name for site in sites)
    assert pmap.choose(IPv4Address("20.1.2.3"), names) == (expected, 8)
    assert closest(*where, sites, names)[0] == expected  # the oracle agrees


def test_candidate_set_changes_the_choice(world_db: GeoDatabase) -> None:
    pmap = ProximityMap(world_db, SITES)
    paris = IPv4Address("1.2.3.200")
    assert pmap.choose(paris, ALL)[0] == "ams1"
    assert pmap.choose(paris, ALL - {"ams1"})[0] == "iad1"
    assert pmap.choose(paris, frozenset({"gru1", "syd1", "nrt1"}))[0] == "gru1"
    assert pmap.rank(paris, frozenset({"gru1", "syd1", "nrt1", "ams1"}))[0] == ("ams1", "gru1", "nrt1", "syd1")


def test_candidate_edge_cases(world_db: GeoDatabase) -> None:
    pmap = ProximityMap(world_db, SITES)
    tokyo = IPv4Address("1.2.0.1")
    assert pmap.choose(tokyo, frozenset()) == (None, 0)
    assert pmap.choose(tokyo, frozenset({"nope1"})) == (None, 0)
    assert pmap.choose(tokyo, frozenset({"nrt1", "nope1"})) == ("nrt1", 0)  # one known: everyone's
    assert pmap.choose(IPv4Address("200.0.0.1"), frozenset({"ams1"})) == ("ams1", 0)
    assert pmap.rank(tokyo, frozenset({"ams1"})) == (("ams1",), 0)
    assert pmap.choose(tokyo, frozenset({"ams1", "nope1", "sfo1"}))[0] == "sfo1"


# --------------------------------------------------------------------------------------------
# Scopes: exact, by brute force


def test_scope_is_widest_uniform_network_ipv4(world_db: GeoDatabase, oracle: Oracle) -> None:
    pmap = ProximityMap(world_db, SITES)
    for names in subsets(ALL):
        for address in V4_PROBES:
            assert_exact(pmap, oracle, address, names)


def test_scope_for_full_order_ipv4(world_db: GeoDatabase, oracle: Oracle) -> None:
    pmap = ProximityMap(world_db, SITES)
    for names in (ALL, ALL - {"ams1"}, frozenset({"iad1", "gru1", "syd1"})):
        for address in V4_PROBES:
            scope = assert_exact(pmap, oracle, address, names, rank=True)
            assert scope >= pmap.choose(address, names)[1]


def test_scope_is_widest_uniform_network_ipv6(world_db: GeoDatabase, oracle: Oracle) -> None:
    pmap = ProximityMap(world_db, SITES)
    for names in (ALL, ALL - {"ams1"}, ALL - {"nrt1", "syd1"}, frozenset({"iad1", "gru1"})):
        for address in V6_PROBES:
            assert_exact(pmap, oracle, address, names)
            assert_exact(pmap, oracle, address, names, rank=True)


def test_known_scopes(world_db: GeoDatabase) -> None:
    pmap = ProximityMap(world_db, SITES)
    # two records at one place: one answer for the whole /8
    assert pmap.choose(IPv4Address("13.200.0.1"), ALL) == ("ams1", 8)
    # Helsinki and Dakar both go to ams1; without it they split at /9
    assert pmap.choose(IPv4Address("14.1.0.0"), ALL) == ("ams1", 8)
    assert pmap.choose(IPv4Address("14.1.0.0"), ALL - {"ams1"}) == ("iad1", 9)
    assert pmap.choose(IPv4Address("14.200.0.0"), ALL - {"ams1"}) == ("gru1", 9)
    # Paris (/25) inside Sydney (/24) inside Tokyo (/16)
    assert pmap.choose(IPv4Address("1.2.3.200"), ALL) == ("ams1", 25)
    assert pmap.choose(IPv4Address("1.2.3.4"), ALL) == ("syd1", 25)
    assert pmap.choose(IPv6Address("2001:db8:1::1"), ALL) == ("syd1", 48)


def test_ipv4_mapped_and_6to4(world_db: GeoDatabase, oracle: Oracle) -> None:
    pmap = ProximityMap(world_db, SITES)
    for text in ("1.2.3.200", "1.2.3.4", "8.8.8.8", "14.200.0.0", "200.1.2.3"):
        v4 = IPv4Address(text)
        mapped = IPv6Address("::ffff:" + text)
        site, scope = pmap.choose(v4, ALL)
        assert pmap.choose(mapped, ALL) == (site, scope + 96)
        assert world_db.locate(mapped) == world_db.locate(v4)
        assert_exact(pmap, oracle, mapped, ALL)
        six_to_four = IPv6Address((0x2002 << 112) | (int(v4) << 80))
        assert pmap.choose(six_to_four, ALL)[0] == site
        assert_exact(pmap, oracle, six_to_four, ALL)


def test_ipv4_mapped_without_alias_in_file(tmp_path: Path) -> None:
    path = tmp_path / "plain.mmdb"
    world_writer(alias_ipv4=False).write(path)
    db = GeoDatabase.open(path)
    oracle = Oracle.open(path)
    pmap = ProximityMap(db, SITES)
    assert pmap.choose(IPv6Address("::ffff:1.2.3.200"), ALL) == ("ams1", 96 + 25)
    for address in [IPv6Address("::ffff:8.8.8.8"), IPv6Address("::fffe:0:1"), IPv6Address("::1:0:0:1"), *V6_PROBES]:
        assert isinstance(address, IPv6Address)
        assert_exact(pmap, oracle, address, ALL, floor=mapped_floor(address))


def test_ipv4_only_database(tmp_path: Path) -> None:
    path = tmp_path / "v4.mmdb"
    world_writer(ip_version=4, record_size=24).write(path)
    db = GeoDatabase.open(path)
    oracle = Oracle.open(path)
    pmap = ProximityMap(db, SITES)
    for address in V4_PROBES[:30]:
        assert_exact(pmap, oracle, address, ALL)
    assert pmap.choose(IPv6Address("2001:db8::1"), ALL) == (None, 3)  # no IPv6 data; not over ::ffff:0:0/96
    assert pmap.choose(IPv6Address("::ffff:1.2.3.200"), ALL) == ("ams1", 121)
    assert db.locate(IPv6Address("2001:db8::1")) is None


# --------------------------------------------------------------------------------------------
# No location, no database, bad files


def test_no_location(world_db: GeoDatabase, oracle: Oracle) -> None:
    pmap = ProximityMap(world_db, SITES)
    for text in ("8.8.8.8", "11.1.1.1", "12.1.1.1", "200.1.1.1", "0.0.0.1"):
        address = IPv4Address(text)
        assert world_db.locate(address) is None
        site, _ = pmap.choose(address, ALL)
        assert site is None
        assert_exact(pmap, oracle, address, ALL)
    assert pmap.choose(IPv4Address("8.8.8.8"), ALL) == (None, 16)
    assert pmap.choose(IPv6Address("2600:1::1"), ALL) == (None, 32)
    assert world_db.corrupt_records >= 1  # 12.0.0.0/8 points at garbage and was counted


def test_locate(world_db: GeoDatabase) -> None:
    assert world_db.locate(IPv4Address("1.2.3.200")) == (48.85, 2.35)
    assert world_db.locate(IPv6Address("2a00:1::5")) == (-23.55, -46.63)
    assert world_db.locate(IPv6Address("::ffff:1.2.0.9")) == (35.68, 139.69)
    assert world_db.locate(IPv6Address("2400::1")) is None
    assert world_db.database_type == "Test-City"


def test_no_database() -> None:
    pmap = ProximityMap(None, SITES)
    assert pmap.choose(IPv4Address("1.2.3.4"), ALL) == (None, 0)
    assert pmap.choose(IPv6Address("2001:db8::1"), ALL) == (None, 0)
    assert pmap.rank(IPv4Address("1.2.3.4"), ALL) == (None, 0)
    assert pmap.choose(IPv4Address("1.2.3.4"), frozenset({"syd1"})) == ("syd1", 0)
    assert pmap.warm() is True


def test_site_validation() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        ProximityMap(None, [Site("ams1", 1, 1), Site("ams1", 2, 2)])
    with pytest.raises(ValueError, match="latitude"):
        Site("bad1", 91.0, 0.0)
    with pytest.raises(ValueError, match="longitude"):
        Site("bad1", 0.0, math.inf)
    assert [s.name for s in ProximityMap(None, SITES).sites] == sorted(ALL)


def _patched(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value) :]


def bad_files(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    good = world_writer(record_size=24).to_bytes()
    cases: list[tuple[str, bytes, str]] = [
        ("empty", b"", "not a valid MaxMind DB"),
        ("garbage", bytes(RANDOM.getrandbits(8) for _ in range(4096)), "not a valid MaxMind DB"),
        ("truncated", good[: len(good) // 2], "not a valid MaxMind DB"),
        ("text", b"this is not a database\n" * 100, "not a valid MaxMind DB"),
        # the first record of node 0 pointing far past the data section
        ("wild pointer", _patched(good, 0, b"\xff\xff\xf0"), "points past the data section"),
    ]
    for name, data, message in cases:
        path = tmp_path / f"{name.replace(' ', '_')}.mmdb"
        path.write_bytes(data)
        yield path, message
    metadata_cases: list[tuple[str, dict[str, object], str]] = [
        ("record size", {"record_size": 20}, "record size"),
        ("node count", {"node_count": 10}, "separator"),
        ("ip version", {"ip_version": 5}, "ip_version"),
        ("missing key", {"node_count": "many"}, "not a valid MaxMind DB"),
    ]
    for name, overrides, message in metadata_cases:
        path = tmp_path / f"{name.replace(' ', '_')}.mmdb"
        world_writer(record_size=24).write(path, overrides)
        yield path, message
    yield tmp_path / "absent.mmdb", "file not found"
    yield tmp_path, "not a valid MaxMind DB"  # a directory


def test_bad_files_give_clear_errors(tmp_path: Path) -> None:
    seen = 0
    for path, message in list(bad_files(tmp_path)):
        with pytest.raises(GeoDatabaseError, match=message) as caught:
            GeoDatabase.open(path)
        assert str(path) in str(caught.value)
        seen += 1
    assert seen == 11


def test_corrupt_record_is_no_location(tmp_path: Path) -> None:
    writer = MmdbWriter()
    writer.insert("20.0.0.0/8", city_record("Amsterdam", 52.37, 4.90))
    writer.insert_raw("21.0.0.0/8", b"\xe2\x41")  # a map of 2 entries, cut short
    writer.insert_raw("22.0.0.0/8", b"\x42\xff")  # a string, not a map
    writer.insert("23.0.0.0/8", city_record("Somewhere", None, 10.0))  # latitude missing
    writer.write(tmp_path / "c.mmdb")
    db = GeoDatabase.open(tmp_path / "c.mmdb")
    for text in ("21.0.0.1", "22.0.0.1", "23.0.0.1"):
        assert db.locate(IPv4Address(text)) is None
    assert db.corrupt_records == 2
    pmap = ProximityMap(db, SITES)
    assert pmap.choose(IPv4Address("21.0.0.1"), ALL) == (None, 8)
    assert pmap.choose(IPv4Address("20.0.0.1"), ALL) == ("ams1", 8)


# --------------------------------------------------------------------------------------------
# Work budget, memo and caches


@pytest.fixture(scope="module")
def uniform(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20.0.0.0/12 as 4096 /24s with 4096 different records, all near Amsterdam; Tokyo around."""
    writer = MmdbWriter(ip_version=4, record_size=24)
    writer.insert("20.0.0.0/8", city_record("Tokyo", 35.68, 139.69))
    for i in range(4096):
        lat, lon = 52.0 + (i % 64) * 0.01, 4.0 + (i // 64) * 0.01
        writer.insert(f"20.{i >> 8}.{i & 255}.0/24", city_record(f"c{i}", lat, lon))
    path = tmp_path_factory.mktemp("uniform") / "uniform.mmdb"
    writer.write(path)
    return path


def is_exact(pmap: ProximityMap) -> bool:
    return pmap.exact


def test_work_budget_bounds_a_cold_call(uniform: Path) -> None:
    db = GeoDatabase.open(uniform)
    oracle = Oracle.open(uniform)
    budget = 400
    pmap = ProximityMap(db, SITES, work_budget=budget)
    address = IPv4Address("20.7.7.7")
    site, scope = pmap.choose(address, ALL)
    assert site == "ams1"
    assert 12 < scope <= 24  # narrower than the true /12, never wider
    assert oracle.answers_in(ipaddress.ip_network((address, scope), strict=False), ALL) == {"ams1"}
    assert pmap.stats.last_work <= budget + ProximityMap.LEAF_COST
    assert pmap.stats.budget_exhausted == 1
    # the narrower answer is cached like any other: asking again costs nothing
    assert pmap.choose(address, ALL) == ("ams1", scope)
    assert pmap.stats.last_work == 0
    # the work is kept: calls for other clients of the region go on from where the last one
    # stopped, each within the budget, until one proves the exact /12
    calls = 0
    best = scope
    while best != 12:
        other = IPv4Address(f"20.{calls % 16}.{(calls * 7) % 256}.1")
        site, wider = pmap.choose(other, ALL)
        assert pmap.stats.last_work <= budget + ProximityMap.LEAF_COST
        assert site == "ams1" and wider >= 12
        best = min(best, wider)
        calls += 1
        assert calls < 400
    assert not is_exact(pmap)
    # warm() finishing drops the answers that were cut short: now the client's scope is exact
    while not pmap.warm(5000):
        pass
    assert is_exact(pmap)
    assert pmap.choose(address, ALL) == ("ams1", 12)
    assert_exact(pmap, oracle, address, ALL)


def test_warm_precomputes_everything(uniform: Path) -> None:
    db = GeoDatabase.open(uniform)
    oracle = Oracle.open(uniform)
    pmap = ProximityMap(db, SITES, work_budget=50)
    slices = 0
    while not pmap.warm(1000):
        slices += 1
        assert slices < 200
    assert slices > 10  # it really was sliced
    for names in (ALL, ALL - {"ams1"}, frozenset({"nrt1", "syd1"})):
        for address in (IPv4Address("20.0.0.0"), IPv4Address("20.15.255.255"), IPv4Address("20.99.0.1")):
            assert_exact(pmap, oracle, address, names)
            assert pmap.stats.last_work <= 50


def test_repeated_calls_hit_the_cache(world_db: GeoDatabase) -> None:
    pmap = ProximityMap(world_db, SITES)
    first = pmap.choose(IPv4Address("14.1.0.0"), ALL)
    hits = pmap.stats.cache_hits
    assert pmap.choose(IPv4Address("14.1.0.77"), ALL) == first  # same /24
    assert pmap.stats.cache_hits == hits + 1
    assert pmap.choose(IPv4Address("14.1.0.77"), ALL - {"ams1"}) == ("iad1", 9)  # other candidates


def test_cache_is_bounded(world_db: GeoDatabase) -> None:
    pmap = ProximityMap(world_db, SITES, cache_entries=64)
    for _ in range(1000):
        pmap.choose(IPv4Address(RANDOM.getrandbits(32)), ALL)
    assert len(pmap._results) <= 64


# --------------------------------------------------------------------------------------------
# Random trees against the oracle

CITIES = [
    (52.37, 4.90), (48.85, 2.35), (35.68, 139.69), (-33.87, 151.21), (40.71, -74.01),
    (37.34, -121.89), (-23.55, -46.63), (1.35, 103.82), (19.08, 72.88), (64.15, -21.94),
    (-18.14, 178.44), (61.22, -149.90), (None, None),
]  # fmt: skip


def random_writer(seed: int, ip_version: int, count: int) -> tuple[MmdbWriter, list[str]]:
    rng = random.Random(seed)
    writer = MmdbWriter(ip_version=ip_version, record_size=rng.choice([24, 28, 32]))
    networks: list[str] = []
    for i in range(count):
        if ip_version == 4 or rng.random() < 0.3:
            length = rng.randint(4, 30)
            net: IPv4Network | IPv6Network = IPv4Network(
                (rng.getrandbits(8) << 24 | rng.getrandbits(24), length), strict=False
            )
        else:
            length = rng.randint(8, 64)
            net = IPv6Network(((0x2 << 124) | rng.getrandbits(124), length), strict=False)
        lat, lon = rng.choice(CITIES)
        # several records share a place: equal answers from different data records
        record = city_record(f"r{i}", lat, lon) if lat is not None else {"country": {"iso_code": "ZZ"}}
        writer.insert(net, record)
        networks.append(str(net))
    return writer, networks


@pytest.mark.parametrize(("seed", "ip_version"), [(1, 4), (2, 4), (3, 6), (4, 6)])
def test_random_trees_match_the_oracle(tmp_path: Path, seed: int, ip_version: int) -> None:
    writer, networks = random_writer(seed, ip_version, 150)
    path = tmp_path / "random.mmdb"
    writer.write(path)
    db = GeoDatabase.open(path)
    oracle = Oracle.open(path)
    rng = random.Random(seed)
    probes = probe_addresses(networks[::3])
    candidate_sets = [frozenset(rng.sample(sorted(ALL), rng.randint(2, 6))) for _ in range(6)]
    exact = ProximityMap(db, SITES)
    starved = ProximityMap(db, SITES, work_budget=15)
    for names in candidate_sets:
        for address in probes:
            assert_exact(exact, oracle, address, names)
            # a starved budget may narrow the scope but never make it wrong
            site, scope = starved.choose(address, names)
            assert site == oracle.answer_at(address, names)
            network = ipaddress.ip_network((address, scope), strict=False)
            assert oracle.answers_in(network, names) == {site}
            assert scope >= exact.choose(address, names)[1]
    assert starved.stats.budget_exhausted > 0
