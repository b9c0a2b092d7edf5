"""Proximity selection against brute force on a real GeoLite2-City: agreement, ECS scopes, cost.

    pip download maxminddb-geolite2==2018.703 --no-deps -d /tmp/geo
    python bench/proximity_eval.py --db /tmp/geo/maxminddb-geolite2-2018.703.tar.gz
    python bench/proximity_eval.py --smoke     # a small synthetic database (no download): does it run?

``--db`` takes the ``.mmdb`` or the sdist it ships in (the database is unpacked to a temporary
folder; nothing is installed). The database is not a project dependency.

Sample (seeded, deterministic): ``--samples`` IPv4 networks drawn uniformly from the database's
data-bearing leaf networks, each turned into the client /24 that holds its first address (an ECS
source /24); a third as many IPv6 networks as /48 clients; and, for contrast, as many /24s
drawn uniformly from the address space that has data (which favours large networks). Sites:
sfo1 iad1 ams1 nrt1 syd1 gru1 (airport coordinates).

For each health scenario (all up; iad1 down; iad1 and ams1 down; all up asking ``rank``, the
whole order) and sample, two tables:

* **agree**: ``ProximityMap.choose`` equals the brute-force closest candidate (for ``rank``: the
  brute-force order), located with ``maxminddb``'s C reader and measured by great-circle
  distance (atan2 of unit vectors): no code shared with ``region_agent.globaldns.geoip.proximity``. Must be 100 %.
  ``flat`` is the agreement of a flat-degree choice (Euclidean distance on latitude and
  longitude, no wrap, as the issue describes PowerDNS 4.7) with the great circle, for contrast.
* **scope**: the scope prefix lengths returned for the /24 (/48) sources: median, p10, p90,
  share wider than the source (< 24) and narrower (> 24: the database splits that /24); cold (a
  fresh map, default work budget) and exact (after ``warm()`` has summarised the whole tree).
  ``exhausted``: cold calls whose work budget ran out (their scope is narrower than the exact
  one, never wider: checked).
* **µs/call**: cold (a fresh map, first call for each client), exact (the map after
  ``warm()``, answer cache cleared: a new client) and hit (the cold map asked for the same
  clients again: its answer cache). Wall-clock p50/p99, and CPU time mean/p99/max (this machine
  is shared; CPU time is steadier).
* **scope proofs**: for ``--verify`` IPv4 clients and a third as many IPv6 ones (all up, exact
  map) the scope is proven by enumerating every leaf network inside it with ``maxminddb`` (all
  give the same answer) and inside the network one bit wider (some other answer).

Memory: RSS (anonymous and file-backed) after opening the database, after building a map, after
its full warm-up, and the peak with a second map after its cold passes.

Results: ``bench/README.md``; every run writes its raw results to the JSON lines file it names at
the end (``--out``). ``--smoke`` runs every scenario on a database written on the spot by
``region_agent/demo/mmdb_writer.py`` (random networks at random places), with a few dozen clients.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import random
import statistics
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

import maxminddb

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Results, add_arguments

from region_agent.globaldns.geoip.proximity import GeoDatabase, ProximityMap, Site

SITES = (
    Site("sfo1", 37.6213, -122.3790),
    Site("iad1", 38.9531, -77.4565),
    Site("ams1", 52.3105, 4.7683),
    Site("nrt1", 35.7720, 140.3929),
    Site("syd1", -33.9399, 151.1753),
    Site("gru1", -23.4356, -46.4731),
)
ALL = frozenset(site.name for site in SITES)
SCENARIOS = (  # (name, healthy sites, whole order instead of the closest only)
    ("all up", ALL, False),
    ("iad1 down", ALL - {"iad1"}, False),
    ("iad1+ams1 down", ALL - {"iad1", "ams1"}, False),
    ("all up, rank()", ALL, True),
)
Address = IPv4Address | IPv6Address


# -- brute force, sharing nothing with region_agent.globaldns.geoip.proximity -----------------------------------------


def great_circle(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    def unit(lat: float, lon: float) -> tuple[float, float, float]:
        phi, lam = math.radians(lat), math.radians(lon)
        return (math.cos(phi) * math.cos(lam), math.cos(phi) * math.sin(lam), math.sin(phi))

    ax, ay, az = unit(lat1, lon1)
    bx, by, bz = unit(lat2, lon2)
    cross = math.hypot(ay * bz - az * by, az * bx - ax * bz, ax * by - ay * bx)
    return math.atan2(cross, ax * bx + ay * by + az * bz)


def located(record: object) -> tuple[float, float] | None:
    if not isinstance(record, dict) or not isinstance(record.get("location"), dict):
        return None
    lat, lon = record["location"].get("latitude"), record["location"].get("longitude")
    if isinstance(lat, float) and isinstance(lon, float):
        return lat, lon
    return None


def brute(where: tuple[float, float] | None, names: frozenset[str]) -> str | None:
    if len(names) == 1:
        return next(iter(names))
    if where is None:
        return None
    return min(
        (s for s in SITES if s.name in names), key=lambda s: (great_circle(*where, s.latitude, s.longitude), s.name)
    ).name


def brute_order(where: tuple[float, float] | None, names: frozenset[str]) -> tuple[str, ...] | None:
    if where is None:
        return None
    chosen = sorted(
        (s for s in SITES if s.name in names), key=lambda s: (great_circle(*where, s.latitude, s.longitude), s.name)
    )
    return tuple(s.name for s in chosen)


def expected(where: tuple[float, float] | None, names: frozenset[str], rank: bool) -> object:
    return brute_order(where, names) if rank else brute(where, names)


def flat(where: tuple[float, float] | None, names: frozenset[str]) -> str | None:
    if where is None:
        return None
    return min(
        (s for s in SITES if s.name in names),
        key=lambda s: (math.hypot(where[0] - s.latitude, where[1] - s.longitude), s.name),
    ).name


# -- sampling --------------------------------------------------------------------------------


def sample_leaves(db: GeoDatabase, version: int, count: int, rng: random.Random) -> list[tuple[int, int]]:
    """A uniform reservoir sample of (network value, prefix length) of data-bearing leaves."""
    tree = db.tree
    n = tree.node_count
    left, right = tree.left, tree.right
    bits = 32 if version == 4 else 128
    root = tree.ipv4_root if version == 4 else 0
    reservoir: list[tuple[int, int]] = []
    seen = 0
    stack = [(root, 0, 0)]
    while stack:
        node, depth, value = stack.pop()
        for bit, child in ((0, left[node]), (1, right[node])):
            prefix = (value << 1) | bit
            if child < n:
                if version == 6 and child == tree.ipv4_root:
                    continue  # ::/96 and its aliases: the IPv4 sample covers them
                stack.append((child, depth + 1, prefix))
            elif child > n:
                seen += 1
                item = (prefix << (bits - depth - 1), depth + 1)
                if len(reservoir) < count:
                    reservoir.append(item)
                else:
                    slot = rng.randrange(seen)
                    if slot < count:
                        reservoir[slot] = item
    return sorted(reservoir)


def clients_from_leaves(leaves: list[tuple[int, int]], version: int) -> list[Address]:
    if version == 4:
        return [IPv4Address(value & ~0xFF) for value, _ in leaves]
    return [IPv6Address(value & ~((1 << 80) - 1)) for value, _ in leaves]


def clients_by_address(reader: maxminddb.Reader, count: int, rng: random.Random) -> list[Address]:
    out: list[Address] = []
    while len(out) < count:
        address = IPv4Address(rng.getrandbits(24) << 8)
        if located(reader.get(address)) is not None:
            out.append(address)
    return out


# -- measuring -------------------------------------------------------------------------------


def rss() -> tuple[float, float]:
    """(anonymous, file-backed) resident memory in MB."""
    fields: dict[str, float] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(rest.split()[0]) / 1024
    return fields.get("RssAnon", 0.0), fields.get("RssFile", 0.0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Timing:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        return {"wall_p50_us": pct(self.wall, 0.5), "wall_p99_us": pct(self.wall, 0.99),
                "cpu_mean_us": statistics.fmean(self.cpu), "cpu_p99_us": pct(self.cpu, 0.99),
                "cpu_max_us": max(self.cpu)} if self.wall else {}

    def summary(self) -> str:
        if not self.wall:
            return "-"
        return (
            f"{pct(self.wall, 0.5):7.1f} {pct(self.wall, 0.99):7.1f}"
            f" {statistics.fmean(self.cpu):7.1f} {pct(self.cpu, 0.99):7.1f} {max(self.cpu):7.1f}"
        )


def timed_pass(
    pmap: ProximityMap, clients: list[Address], names: frozenset[str], rank: bool = False
) -> tuple[list[int], list[object], Timing]:
    timing = Timing()
    scopes: list[int] = []
    answers: list[object] = []
    perf, cpu = time.perf_counter, time.thread_time
    call = pmap.rank if rank else pmap.choose
    for address in clients:
        w0, c0 = perf(), cpu()
        site, scope = call(address, names)
        w1, c1 = perf(), cpu()
        timing.wall.append((w1 - w0) * 1e6)
        timing.cpu.append((c1 - c0) * 1e6)
        scopes.append(scope)
        answers.append(site)
    return scopes, answers, timing


def scope_figures(scopes: list[int], source: int) -> dict[str, float]:
    return {"median": statistics.median(scopes), "p10": pct([float(s) for s in scopes], 0.1),
            "p90": pct([float(s) for s in scopes], 0.9),
            "wider_percent": sum(1 for s in scopes if s < source) / len(scopes) * 100,
            "narrower_percent": sum(1 for s in scopes if s > source) / len(scopes) * 100}


def scope_summary(scopes: list[int], source: int) -> str:
    wider = sum(1 for s in scopes if s < source) / len(scopes) * 100
    narrower = sum(1 for s in scopes if s > source) / len(scopes) * 100
    return (
        f"/{statistics.median(scopes):<4g} /{pct([float(s) for s in scopes], 0.1):<3g}"
        f" /{pct([float(s) for s in scopes], 0.9):<3g} {wider:5.1f}% {narrower:5.1f}%"
    )


def verify_scope(reader: maxminddb.Reader, address: Address, scope: int, names: frozenset[str], cap: int) -> str:
    """'ok', 'not widest', 'WRONG' or 'skipped' (more than ``cap`` leaves to enumerate)."""

    def answers(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> set[str | None] | None:
        found: set[str | None] = set()
        value, last = int(network.network_address), int(network.broadcast_address)
        bits = network.max_prefixlen
        steps = 0
        while value <= last and len(found) < 2:
            ip = IPv4Address(value) if bits == 32 else IPv6Address(value)
            record, length = reader.get_with_prefix_len(ip)
            found.add(brute(located(record), names))
            value = (value | ((1 << (bits - length)) - 1)) + 1
            steps += 1
            if steps > cap:
                return None
        return found

    expected = brute(located(reader.get(address)), names)
    inside = answers(ipaddress.ip_network((address, scope), strict=False))
    if inside is None:
        return "skipped"
    if inside != {expected}:
        return "WRONG"
    if scope == 0:
        return "ok"
    wider = answers(ipaddress.ip_network((address, scope - 1), strict=False))
    if wider is None:
        return "skipped"
    return "ok" if len(wider) == 2 else "not widest"


# -- main ------------------------------------------------------------------------------------


def synthetic_database(scratch: Path, seed: int) -> Path:
    """A small City-shaped database: random IPv4 /8-/20 and IPv6 /24-/40 networks at random places."""
    from region_agent.demo.mmdb_writer import MmdbWriter, city_record

    rng = random.Random(seed)
    writer = MmdbWriter()
    for first in rng.sample(range(1, 224), 96):
        writer.insert(f"{first}.0.0.0/8", city_record(f"c{first}", rng.uniform(-60, 70), rng.uniform(-180, 180)))
        for _ in range(rng.randrange(4)):  # more specific networks elsewhere inside it
            length = rng.randrange(12, 21)
            network = ipaddress.ip_network((first << 24 | rng.getrandbits(24), length), strict=False)
            writer.insert(network, city_record("n", rng.uniform(-60, 70), rng.uniform(-180, 180)))
    writer.insert("1.2.3.0/24", city_record("nowhere", None, None))  # a record without a location
    for _ in range(40):
        length = rng.randrange(24, 41)
        network = ipaddress.ip_network(((0x2000 + rng.getrandbits(12)) << 112 | rng.getrandbits(112), length),
                                       strict=False)
        writer.insert(network, city_record("v6", rng.uniform(-60, 70), rng.uniform(-180, 180)))
    path = scratch / "synthetic-City.mmdb"
    writer.write(path)
    return path


def database_path(given: str, scratch: Path) -> Path:
    path = Path(given)
    if path.suffix == ".mmdb":
        return path
    with tarfile.open(path) as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith("GeoLite2-City.mmdb"))
        member.name = "GeoLite2-City.mmdb"
        archive.extract(member, scratch, filter="data")
    return scratch / "GeoLite2-City.mmdb"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default="/tmp/geo/maxminddb-geolite2-2018.703.tar.gz")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=20180703)
    parser.add_argument("--verify", type=int, default=300, help="clients whose scope is proven by enumeration")
    parser.add_argument("--verify-cap", type=int, default=300_000, help="leaves enumerated per proof at most")
    parser.add_argument("--warm-slice", type=int, default=2000)
    add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.verify, args.verify_cap, args.warm_slice = 60, 9, 20_000, 200

    with tempfile.TemporaryDirectory() as scratch, Results("proximity_eval", args.out, smoke=args.smoke) as results:
        path = synthetic_database(Path(scratch), args.seed) if args.smoke else database_path(args.db, Path(scratch))
        return run(path, args, results)


def run(path: Path, args: argparse.Namespace, results: Results) -> int:
    rng = random.Random(args.seed)
    base_anon, base_file = rss()
    started = time.perf_counter()
    db = GeoDatabase.open(path)
    opened = time.perf_counter() - started
    open_anon, open_file = rss()
    reader = maxminddb.open_database(str(path))
    meta = reader.metadata()
    print(f"database: {path.name} {meta.database_type} build {meta.build_epoch} nodes {meta.node_count}")
    results.add("database", file=path.name, database_type=meta.database_type, build_epoch=meta.build_epoch,
                nodes=meta.node_count, open_ms=opened * 1000, rss_open_anon_mb=open_anon - base_anon,
                rss_open_file_mb=open_file - base_file)
    print(f"sites: {' '.join(f'{s.name}({s.latitude:.2f},{s.longitude:.2f})' for s in SITES)}")
    print(
        f"open: {opened * 1000:.0f} ms, RSS +{open_anon - base_anon:.1f} MB anon +{open_file - base_file:.1f} MB file"
    )

    t0 = time.perf_counter()
    v4 = clients_from_leaves(sample_leaves(db, 4, args.samples, rng), 4)
    v6 = clients_from_leaves(sample_leaves(db, 6, max(1, args.samples // 3), rng), 6)
    spread = clients_by_address(reader, args.samples, rng)
    rng.shuffle(v4)
    rng.shuffle(v6)
    print(f"sampling: {time.perf_counter() - t0:.1f} s")
    samples: list[tuple[str, list[Address], int]] = [
        ("v4 networks /24", v4, 24),
        ("v4 space /24", spread, 24),
        ("v6 networks /48", v6, 48),
    ]
    where: dict[Address, tuple[float, float] | None] = {}
    for _, clients, _ in samples:
        for address in clients:
            where[address] = located(reader.get(address))
    unlocated = sum(1 for value in where.values() if value is None)
    print(f"clients: {len(v4)} + {len(spread)} IPv4 /24, {len(v6)} IPv6 /48; {unlocated} without location")

    # one map summarised ahead by warm(): its memo serves every candidate set
    exact = ProximityMap(db, SITES)
    built_anon, _ = rss()
    w0, c0 = time.perf_counter(), time.process_time()
    slices, longest = 0, 0.0
    while True:
        s0 = time.process_time()
        done = exact.warm(args.warm_slice)
        longest = max(longest, time.process_time() - s0)
        slices += 1
        if done:
            break
    warm_wall, warm_cpu = time.perf_counter() - w0, time.process_time() - c0
    warm_anon, _ = rss()
    print(
        f"warm(): {warm_cpu:.1f} s CPU ({warm_wall:.1f} s wall) in {slices} slices of {args.warm_slice} units,"
        f" longest slice {longest * 1000:.1f} ms CPU; {len(exact._summaries) - 1} distinct subtree summaries,"
        f" {len(exact._orders) - 1} distinct rankings"
    )
    results.add("warm", cpu_seconds=warm_cpu, wall_seconds=warm_wall, slices=slices, slice_units=args.warm_slice,
                longest_slice_cpu_ms=longest * 1000, summaries=len(exact._summaries) - 1,
                rankings=len(exact._orders) - 1)

    rows: list[str] = []
    times: list[str] = []
    header = (
        f"{'scenario':<15} {'sample':<16} {'agree':>7} {'flat':>6}   "
        f"{'cold scope: med p10 p90 <src >src':<35} {'exact scope: med p10 p90 <src >src':<35} exhausted"
    )
    time_header = (
        f"{'scenario':<15} {'sample':<16} "
        f"{'cold µs: p50 p99 cpu-mean p99 max':<41} {'exact µs: p50 p99 cpu-mean p99 max':<41} "
        "hit µs: p50 p99 cpu-mean p99 max"
    )
    failures = 0
    cold_anon = 0.0
    for scenario, names, rank in SCENARIOS:
        cold_map = ProximityMap(db, SITES)
        for label, clients, source in samples:
            before = cold_map.stats.budget_exhausted
            scopes_cold, answers, timing_cold = timed_pass(cold_map, clients, names, rank)
            exhausted = cold_map.stats.budget_exhausted - before
            agree = sum(1 for a, s in zip(clients, answers, strict=True) if s == expected(where[a], names, rank))
            agree_flat = sum(1 for a in clients if flat(where[a], names) == brute(where[a], names))
            failures += len(clients) - agree
            timing_hit = timed_pass(cold_map, clients, names, rank)[2]
            exact._results.clear()
            scopes_exact, answers_exact, timing_exact = timed_pass(exact, clients, names, rank)
            failures += sum(
                1 for a, s in zip(clients, answers_exact, strict=True) if s != expected(where[a], names, rank)
            )
            failures += sum(1 for c, e in zip(scopes_cold, scopes_exact, strict=True) if c < e)  # never wider
            total = len(clients)
            flat_text = "-" if rank else f"{agree_flat / total * 100:5.1f}%"
            rows.append(
                f"{scenario:<15} {label:<16} {agree / total * 100:6.2f}% {flat_text:>6}   "
                f"{scope_summary(scopes_cold, source):<35} {scope_summary(scopes_exact, source):<35} "
                f"{exhausted}/{total}"
            )
            times.append(
                f"{scenario:<15} {label:<16} {timing_cold.summary():<41} {timing_exact.summary():<41} "
                f"{timing_hit.summary()}"
            )
            results.add("scenario", scenario=scenario, sample=label, clients=total, agree_percent=agree / total * 100,
                        flat_agree_percent=None if rank else agree_flat / total * 100,
                        scope_cold=scope_figures(scopes_cold, source),
                        scope_exact=scope_figures(scopes_exact, source), exhausted=exhausted,
                        cold=timing_cold.figures(), exact=timing_exact.figures(), hit=timing_hit.figures())
        cold_anon = max(cold_anon, rss()[0])
        del cold_map

    print()
    print(header)
    for row in rows:
        print(row)
    print()
    print(time_header)
    for row in times:
        print(row)
    print()
    results.add("memory", fresh_map_mb=built_anon - open_anon, after_warm_mb=warm_anon - open_anon,
                second_map_peak_mb=cold_anon - open_anon)
    print(
        f"memory (RSS anon over the open database): a fresh map +{built_anon - open_anon:.1f} MB,"
        f" after the full warm() +{warm_anon - open_anon:.1f} MB,"
        f" peak with a second map after its cold passes +{cold_anon - open_anon:.1f} MB"
    )

    # proofs of exactness for a subsample, all up, after warm
    proof_rng = random.Random(args.seed + 1)
    chosen = proof_rng.sample(v4, min(args.verify, len(v4))) + proof_rng.sample(v6, min(args.verify // 3, len(v6)))
    tally: dict[str, int] = {}
    t0 = time.perf_counter()
    for address in chosen:
        _, scope = exact.choose(address, ALL)
        verdict = verify_scope(reader, address, scope, ALL, args.verify_cap)
        tally[verdict] = tally.get(verdict, 0) + 1
    print(
        f"scope proofs (all up, exact map, {len(chosen)} clients, {time.perf_counter() - t0:.0f} s): "
        + ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
    )
    failures += tally.get("WRONG", 0) + tally.get("not widest", 0)
    results.add("scope_proofs", clients=len(chosen), verdicts=tally, failures=failures)
    print("RESULT:", "ok" if failures == 0 else f"{failures} FAILURES")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
