"""Proximity selection: the closest healthy site to a client, with the widest correct ECS scope.

``proximity`` answers give the healthy site (region) closest to the client by great-circle
distance (haversine on a sphere; longitudes wrap, so the date line and the poles need no special
case) from the client's location in a MaxMind-format city database. The answer also carries an
EDNS Client Subnet scope: the prefix length of the **widest network around the client in which
every address gets the same answer**, so that a resolver caches one answer for all of them.

API (one :class:`ProximityMap` per (database, sites); health changes only change ``candidates``)::

    db = GeoDatabase.open("GeoLite2-City.mmdb")            # GeoDatabaseError on a bad file
    pmap = ProximityMap(db, [Site("ams1", 52.37, 4.90), Site("sfo1", 37.62, -122.38)])
    site, scope = pmap.choose(client, frozenset({"ams1", "sfo1"}))   # closest healthy site
    order, scope = pmap.rank(client, healthy)               # healthy sites, closest first

``site``/``order`` is None when the client has no location (no database, no data for its
network, or a record without coordinates): the caller answers every healthy address, and
``scope`` is then the widest network that is unlocated too. With exactly one candidate every
client gets it, located or not, so the answer is that candidate with scope 0. ``scope`` is in the
address's family; an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``) is located as its IPv4
address and its scope is 96 + the IPv4 scope. Build one map over *all* regions and pass each
project's healthy regions as ``candidates``: the map's memory does not depend on the candidates.

Algorithm
---------
* **Leaves.** The database's search tree (see :mod:`region_agent.globaldns.geoip.mmdb_tree`) ends in record values;
  equal values are the same data record. Each distinct value is decoded once (only its
  ``location``) and mapped to its *ranking*: every site index ordered by (haversine distance,
  name). Sites are indexed in name order, so ties go to the smaller name on every agent.
* **Summaries.** A subtree's answers for *every* candidate set are captured by one integer, its
  *summary*: bit ``s*S+t`` is set iff site ``s`` comes before site ``t`` in the ranking of every
  located leaf below (the intersection of the leaves' orders), plus a flag "has a located leaf"
  and a flag "has an unlocated leaf". The summary of a node is the *meet* of its children's
  (AND of the order bits, OR of the flags), so it is computed bottom-up and does not depend on
  the path that reached the node (MaxMind trees are DAGs: ``::ffff:0:0/96`` and ``2002::/16``
  point at the IPv4 subtree).
* **Uniformity test in O(1).** A client whose leaf answers ``s`` for candidates ``C`` needs every
  leaf of a subtree to rank ``s`` before every other member of ``C`` and to be located:
  ``summary & M == R`` with ``R`` = the bits ``s*S+t`` for ``t`` in ``C - {s}`` and
  ``M = R | UNLOCATED``. For :meth:`ProximityMap.rank` ``R`` holds every ordered pair of the
  client's restricted order; for an unlocated client ``M = LOCATED, R = 0``. The test is exact
  (not just sufficient): the network of a node is uniform iff the test holds. It is also a
  conjunction over the leaves, so a search may stop at the first failing leaf.
* **Widening.** Walk from the root to the client's leaf (depth ``d``), then for ``i = d-1 … 0``
  the network at depth ``i`` is uniform iff the sibling subtree at depth ``i+1`` passes the
  test; stop at the first that does not. Scope = the last depth that passed.
* **Memo.** Sibling summaries come from a per-node memo (``array('I')`` of summary ids, 4 bytes
  per tree node, interned summaries). A missing one is computed by a depth-first search (no
  deeper than the address width) that memoizes every subtree it completes and stops at the
  first failing leaf. The memo does not depend on the candidates, so health changes keep it.

Bounds
------
* Warm call (answer cached for the client's /24 or /48 — or its exact address when the
  database splits that /24 or /48 — and candidate set): one or two dict lookups, about 1-2 µs.
  Cache miss with the memo warm: one walk plus one O(1) test per widened level, about 10-20 µs
  (IPv4 ≤ 32 levels, IPv6 ≤ 128; plus a record decode, ~10 µs, when the client's record is not
  in the decoded-record cache).
* Cold call: the searches of one call share ``work_budget`` units (default 2,000): one per
  tree node entered or probed, ``LEAF_COST`` (10) per record decoded; a unit is about 1 µs of
  CPU, so a call costs at most about ``budget + LEAF_COST`` units, 2-4 ms. Before a full search
  a sibling is probed down three single paths, which rejects most non-uniform siblings in
  O(depth). When the budget runs out the call answers the scope proven so far — narrower,
  never wrong — and caches it like any answer; the work already done stays memoized, so later
  calls for other clients nearby go on from there. :meth:`ProximityMap.warm` does all the work
  ahead, in slices (about 11 s of CPU for GeoLite2-City), after which every scope is exact and
  answers cut short before are dropped from the cache.
* Memory: the tree as two ``array('I')`` (8 bytes per node, in :class:`GeoDatabase`), the memo
  (4 bytes per node), direct-mapped caches of decoded records and of places (fixed arrays,
  9 MB), interned summaries (at most ``MAX_SUMMARIES``; 2.7 k for GeoLite2-City and six
  sites), and the answer cache (at most ``cache_entries``, cleared when full). For
  GeoLite2-City (3.6 M nodes): about 29 MB + 14 MB + 9 MB. Nothing grows with the number of
  distinct clients beyond those caps.

Not thread-safe: call a map from one thread (the event loop). Pure: no I/O after ``open``.
"""

from __future__ import annotations

import itertools
import math
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from typing import Final, cast

from region_agent.globaldns.geoip.mmdb_tree import GeoDatabaseError, SearchTree, is_ipv4_mapped

__all__ = [
    "EARTH_RADIUS_KM",
    "GeoDatabase",
    "GeoDatabaseError",
    "ProximityMap",
    "ProximityStats",
    "Site",
    "haversine_km",
]

EARTH_RADIUS_KM: Final = 6371.0088

_FIRST: Final = 0
_RANK: Final = 1
_MAPPED_PREFIX_BITS: Final = 0xFFFF  # the first 96 bits of ::ffff:0:0 are 0^80 1^16
_UNLOCATED_RANKING: Final = 0
_ALL_ONES: Final = (1 << 128) - 1
_HASH_MULTIPLIER: Final = 0x9E3779B97F4A7C15


def haversine_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Great-circle distance in km between two (latitude, longitude) points in degrees."""
    phi1 = math.radians(lat1)
    phi2 = math.radians(lat2)
    half_dphi = (phi2 - phi1) / 2.0
    half_dlambda = math.radians(lon2 - lon1) / 2.0
    h = math.sin(half_dphi) ** 2 + math.cos(phi1) * math.cos(phi2) * math.sin(half_dlambda) ** 2
    return 2.0 * EARTH_RADIUS_KM * math.asin(math.sqrt(min(1.0, max(0.0, h))))


@dataclass(frozen=True, slots=True)
class Site:
    """A place answers can be sent to: a region's name and location in degrees."""

    name: str
    latitude: float
    longitude: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("site name must not be empty")
        if not (math.isfinite(self.latitude) and -90.0 <= self.latitude <= 90.0):
            raise ValueError(f"site {self.name}: latitude {self.latitude} is not in [-90, 90]")
        if not (math.isfinite(self.longitude) and -180.0 <= self.longitude <= 180.0):
            raise ValueError(f"site {self.name}: longitude {self.longitude} is not in [-180, 180]")


class GeoDatabase:
    """A MaxMind-format city database (GeoLite2-City, GeoIP2-City, …), opened read-only."""

    __slots__ = ("tree",)

    def __init__(self, tree: SearchTree) -> None:
        self.tree = tree

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GeoDatabase:
        """Open and check a database file; GeoDatabaseError names the file and the problem.

        Takes about 0.3 s and 30 MB for GeoLite2-City (the search tree is copied into arrays);
        run it off the event loop when reloading.
        """
        return cls(SearchTree.open(path))

    def close(self) -> None:
        """Unmap the data section. Maps built on this database must not be used afterwards."""
        self.tree.close()

    @property
    def path(self) -> str:
        return self.tree.path

    @property
    def database_type(self) -> str:
        return self.tree.metadata.database_type

    @property
    def build_epoch(self) -> int:
        return self.tree.metadata.build_epoch

    @property
    def corrupt_records(self) -> int:
        """Data records met so far that did not decode (each treated as "no location")."""
        return self.tree.corrupt_records

    def locate(self, address: IPv4Address | IPv6Address) -> tuple[float, float] | None:
        """(latitude, longitude) of an address, or None when the database has none for it."""
        record, _ = self.tree.lookup(address)
        return self.tree.location(record)


@dataclass(slots=True)
class ProximityStats:
    """Counters of a :class:`ProximityMap`, for metrics and tests."""

    calls: int = 0
    cache_hits: int = 0
    budget_exhausted: int = 0
    work: int = 0
    last_work: int = 0


class ProximityMap:
    """Closest-site choice with an exact ECS scope, for one database and one set of sites.

    See the module docstring for the algorithm and its bounds.
    """

    DEFAULT_WORK_BUDGET: Final = 2000
    LEAF_COST: Final = 10
    MAX_SUMMARIES: Final = 1 << 20
    LEAF_SLOTS: Final = 1 << 20
    PLACE_SLOTS: Final = 1 << 16
    MAX_MASKS: Final = 4096
    MAX_REQUIREMENTS: Final = 1 << 16

    def __init__(
        self,
        db: GeoDatabase | None,
        sites: Sequence[Site],
        *,
        work_budget: int = DEFAULT_WORK_BUDGET,
        cache_entries: int = 1 << 16,
    ) -> None:
        if work_budget < 1:
            raise ValueError("work_budget must be at least 1")
        ordered = sorted(sites, key=lambda site: site.name)
        for first, second in itertools.pairwise(ordered):
            if first.name == second.name:
                raise ValueError(f"duplicate site name {first.name!r}")
        self._db = db
        self._sites: tuple[Site, ...] = tuple(ordered)
        self._names: tuple[str, ...] = tuple(site.name for site in ordered)
        self._index: dict[str, int] = {name: i for i, name in enumerate(self._names)}
        count = len(ordered)
        self._count = count
        self._located: int = 1 << (count * count)
        self._unlocated: int = self._located << 1
        self._flags: int = self._located | self._unlocated
        self._top: int = self._located - 1  # every order bit, no flag: the meet's identity
        self._budget = work_budget
        self._cache_entries = cache_entries
        self.stats = ProximityStats()

        # record value -> ranking id, and place -> ranking id: direct-mapped caches in flat
        # arrays (fixed memory, nothing for the GC to scan, no clearing spikes)
        self._leaf_keys = array("I", [0]) * self.LEAF_SLOTS  # record value (0: empty slot)
        self._leaf_rankings = array("I", [0]) * self.LEAF_SLOTS
        self._place_latitudes = array("d", [math.nan]) * self.PLACE_SLOTS
        self._place_longitudes = array("d", [math.nan]) * self.PLACE_SLOTS
        self._place_rankings = array("I", [0]) * self.PLACE_SLOTS
        self._trig = [
            (math.radians(site.latitude), math.radians(site.longitude), math.cos(math.radians(site.latitude)))
            for site in ordered
        ]
        self._ranking_ids: dict[tuple[int, ...], int] = {(): _UNLOCATED_RANKING}
        self._orders: list[tuple[int, ...]] = [()]
        self._leaf_summaries: list[int] = [self._top | self._unlocated]
        # node memo: summary id per tree node (0 = not known yet), ids index _summaries
        self._summary_ids: dict[int, int] = {}
        self._summaries: list[int] = [0]
        self._masks: dict[frozenset[str], int] = {}
        self._requirements: dict[tuple[int, int, int], tuple[object, int, int]] = {}
        self._results: dict[tuple[int, int, int, int], tuple[object, int]] = {}
        self._provisional = False  # the answer cache holds scopes cut short by the budget
        self._work = 0
        self._must = 0
        self._required = 0
        if db is not None:
            tree = db.tree
            self._tree: SearchTree | None = tree
            self._n = tree.node_count
            self._left = tree.left
            self._right = tree.right
            self._memo = array("I", [0]) * tree.node_count
            self._v6_start = tree.start(6)
            self._v4_start = tree.ipv4_root
            # Without the file's own alias, ::ffff:0:0/96 answers like IPv4 here but not in the
            # tree, so an IPv6 scope must never cover it.
            self._guard_mapped = not tree.mapped_aliased
        else:
            self._tree = None
            self._n = 0
            self._left = self._right = self._memo = array("I")
            self._v6_start = None
            self._v4_start = 0
            self._guard_mapped = False

    @property
    def sites(self) -> tuple[Site, ...]:
        """The sites, in name order."""
        return self._sites

    def choose(self, address: IPv4Address | IPv6Address, candidates: frozenset[str]) -> tuple[str | None, int]:
        """The closest candidate site to ``address`` and the ECS scope prefix length.

        ``address`` is the ECS address (as received, masked to its source prefix) or else the
        query's source address. Every address in ``address/scope`` gets the same result, and the
        network one bit wider does not — except where the work budget ran out (narrower, see
        :attr:`exact`), at the IPv4-mapped boundary (/96), and in a database that does not alias
        ``::ffff:0:0/96`` itself, where IPv6 scopes stay off that network. The scope may be
        longer than an ECS source prefix when the database splits that prefix (RFC 7871 allows
        it: the answer is then only valid for that part). Returns ``(None, scope)`` when the
        address has no location (the caller answers all healthy addresses) or no candidate is a
        known site. Unknown names are ignored.
        """
        result, scope = self._answer(address, candidates, _FIRST)
        return cast("str | None", result), scope

    def rank(
        self, address: IPv4Address | IPv6Address, candidates: frozenset[str]
    ) -> tuple[tuple[str, ...] | None, int]:
        """The candidate sites ordered closest first, and the scope over which that whole order
        holds (never wider than :meth:`choose`'s scope). ``(None, scope)`` without a location."""
        result, scope = self._answer(address, candidates, _RANK)
        return cast("tuple[str, ...] | None", result), scope

    def warm(self, work: int = 20_000) -> bool:
        """Precompute subtree summaries for up to ``work`` units; True once the whole tree is.

        Optional. Without it the memo fills as queries explore the tree, and clients in large
        uniform networks get a narrower (still correct) scope until enough calls have covered
        them. Calling ``warm`` in slices from the event loop (e.g. 2,000 units ≈ 2-3 ms at a
        time) until it returns True makes every later call exact and cheap. A whole
        GeoLite2-City takes about 3.6 M node units plus one decode per distinct record
        (≈ 10 s of CPU in total).
        """
        if self._tree is None or self._count < 2:
            return True
        if self._memo[0]:
            return True
        self._work = work
        self._must = 0
        self._required = 0  # every summary passes: a plain bottom-up computation
        room = 128 if self._tree.metadata.ip_version == 6 else 32
        try:
            self._subtree(0, room)
        except _OutOfWorkError:
            return False
        finally:
            used = work - self._work
            self.stats.work += used
        if self._provisional:  # answers cut short by the budget: recompute them exactly
            self._results.clear()
            self._provisional = False
        return bool(self._memo[0])

    @property
    def exact(self) -> bool:
        """Whether every subtree is summarised, so that every scope is the widest (see warm)."""
        return self._tree is None or self._count < 2 or bool(self._memo[0])

    # -- the hot path ---------------------------------------------------------------------------

    def _mask(self, candidates: frozenset[str]) -> int:
        mask = self._masks.get(candidates)
        if mask is None:
            mask = 0
            index = self._index
            for name in candidates:
                i = index.get(name)
                if i is not None:
                    mask |= 1 << i
            if len(self._masks) >= self.MAX_MASKS:
                self._masks.clear()
            self._masks[candidates] = mask
        return mask

    def _answer(self, address: IPv4Address | IPv6Address, candidates: frozenset[str], mode: int) -> tuple[object, int]:
        stats = self.stats
        stats.calls += 1
        stats.last_work = 0
        mask = self._mask(candidates)
        if mask == 0:
            return None, 0
        if mask & (mask - 1) == 0:  # one candidate: it is the answer everywhere
            name = self._names[mask.bit_length() - 1]
            return (name if mode == _FIRST else (name,)), 0
        if self._tree is None:
            return None, 0
        value = int(address)
        offset = 0
        if address.version == 4:
            bits = 32
            start = self._v4_start
            key = (4, value >> 8, mask, mode)
            cacheable_depth = 24
            floor = 0
        elif is_ipv4_mapped(value):
            value &= 0xFFFFFFFF
            bits = 32
            start = self._v4_start
            key = (4, value >> 8, mask, mode)
            cacheable_depth = 24
            offset = 96
            floor = 0
        else:
            floor = _mapped_floor(value) if self._guard_mapped or self._v6_start is None else 0
            if self._v6_start is None:  # an IPv4-only database: no IPv6 address is located
                return None, floor
            bits = 128
            start = 0
            key = (6, value >> 80, mask, mode)
            cacheable_depth = 48 if floor <= 48 else -1
        results = self._results
        cached = results.get(key)
        if cached is None:
            # a client in a network narrower than the /24 (/48) is cached by its own address
            cached = results.get((key[0] + 1, value, mask, mode))
        if cached is not None:
            stats.cache_hits += 1
            return cached[0], cached[1] + offset
        result, scope, depth, complete = self._solve(value, bits, start, mask, mode)
        scope = max(scope, floor)
        # A scope cut short by the budget is cached too (it is correct, only narrower), so a
        # client pays for the search once; warm() completing drops such answers.
        if len(results) >= self._cache_entries:
            results.clear()
            self._provisional = False
        if depth <= cacheable_depth:
            results[key] = (result, scope)
        else:
            results[(key[0] + 1, value, mask, mode)] = (result, scope)
        if not complete:
            self._provisional = True
        return result, scope + offset

    def _solve(self, value: int, bits: int, start: int, mask: int, mode: int) -> tuple[object, int, int, bool]:
        """(answer, scope, leaf depth, whether the budget sufficed) for an address in a tree."""
        n = self._n
        left = self._left
        right = self._right
        node = start
        depth = 0
        path: list[int] = []
        while node < n:
            if depth == bits:  # a corrupt tree deeper than the address: no location, no widening
                return None, bits, bits, True
            path.append(node)
            node = right[node] if (value >> (bits - 1 - depth)) & 1 else left[node]
            depth += 1
        self._work = self._budget
        ranking = self._leaf_ranking(node)
        result, must, required = self._requirement(ranking, mask, mode)
        memo = self._memo
        summaries = self._summaries
        scope = depth
        complete = True
        for i in range(depth - 1, -1, -1):
            if self._work <= 0:
                complete = False
                self.stats.budget_exhausted += 1
                break
            parent = path[i]
            sibling = left[parent] if (value >> (bits - 1 - i)) & 1 else right[parent]
            if sibling >= n:
                summary = self._leaf_summary(sibling)
            else:
                known = memo[sibling]
                if not known:
                    verdict = self._explore(sibling, must, required, bits - i - 1, _mix(value + i))
                    if verdict is None:
                        complete = False
                        self.stats.budget_exhausted += 1
                        break
                    if not verdict:
                        break
                    scope = i
                    continue
                summary = summaries[known]
            if summary & must != required:
                break
            scope = i
        used = self._budget - self._work
        self.stats.last_work = used
        self.stats.work += used
        return result, scope, depth, complete

    def _explore(self, root: int, must: int, required: int, room: int, seed: int) -> bool | None:
        """Whether every leaf under node ``root`` passes ``summary & must == required``.

        First a few probes down single paths (cheap rejection of the usual, non-uniform case),
        then a depth-first search that memoizes each subtree it completes and stops at the
        first failing leaf. None when the work budget runs out or the tree is deeper than
        ``room`` more levels (only a corrupt tree is).
        """
        self._must = must
        self._required = required
        try:
            for pattern in (_ALL_ONES, seed, ~seed):
                self._probe(root, room, pattern)
            self._subtree(root, room)
        except _DifferentAnswerError:
            return False
        except _OutOfWorkError:
            return None
        return True

    def _probe(self, node: int, room: int, pattern: int) -> None:
        """Follow one path below ``node`` (bit ``k`` of ``pattern`` at level ``k``) and test the
        leaf or memoized subtree where it ends; raises _DifferentAnswerError if it fails the test."""
        n = self._n
        left = self._left
        right = self._right
        memo = self._memo
        for level in range(room):
            self._work -= 1
            if self._work <= 0:
                raise _OutOfWorkError
            node = right[node] if (pattern >> level) & 1 else left[node]
            if node >= n:
                self._check(self._leaf_summary(node))
                return
            known = memo[node]
            if known:
                self._check(self._summaries[known])
                return
        raise _OutOfWorkError

    def _subtree(self, node: int, room: int) -> int:
        """The summary of node ``node`` (memoized), or _DifferentAnswerError / _OutOfWorkError."""
        work = self._work - 1
        if work <= 0 or room <= 0:
            raise _OutOfWorkError
        self._work = work
        n = self._n
        child = self._left[node]
        if child >= n:
            first = self._leaf_summary(child)
        else:
            known = self._memo[child]
            first = self._summaries[known] if known else self._subtree(child, room - 1)
        if first & self._must != self._required:
            raise _DifferentAnswerError
        child = self._right[node]
        if child >= n:
            second = self._leaf_summary(child)
        else:
            known = self._memo[child]
            second = self._summaries[known] if known else self._subtree(child, room - 1)
        if second & self._must != self._required:
            raise _DifferentAnswerError
        summary = (first & second) | ((first | second) & self._flags)
        self._memoize(node, summary)
        return summary

    def _memoize(self, node: int, summary: int) -> None:
        known = self._summary_ids.get(summary)
        if known is None:
            if len(self._summaries) >= self.MAX_SUMMARIES:
                return  # keep computing, stop remembering: memory stays bounded
            known = len(self._summaries)
            self._summaries.append(summary)
            self._summary_ids[summary] = known
        self._memo[node] = known

    def _check(self, summary: int) -> None:
        if summary & self._must != self._required:
            raise _DifferentAnswerError

    def _leaf_summary(self, record: int) -> int:
        return self._leaf_summaries[self._leaf_ranking(record)]

    def _leaf_ranking(self, record: int) -> int:
        """Ranking id of a leaf record value: decoded once, kept in a direct-mapped cache."""
        if record == self._n:
            return _UNLOCATED_RANKING
        slot = ((record * _HASH_MULTIPLIER) >> 16) & (self.LEAF_SLOTS - 1)
        if self._leaf_keys[slot] == record:
            return self._leaf_rankings[slot]
        if self._work <= 0:
            raise _OutOfWorkError
        self._work -= self.LEAF_COST
        assert self._tree is not None
        location = self._tree.location(record)
        ranking = _UNLOCATED_RANKING if location is None else self._place_ranking(location)
        self._leaf_keys[slot] = record
        self._leaf_rankings[slot] = ranking
        return ranking

    def _place_ranking(self, location: tuple[float, float]) -> int:
        latitude, longitude = location
        slot = hash(location) & (self.PLACE_SLOTS - 1)
        if self._place_latitudes[slot] == latitude and self._place_longitudes[slot] == longitude:
            return self._place_rankings[slot]
        ranking = self._rank_location(location)
        self._place_latitudes[slot] = latitude
        self._place_longitudes[slot] = longitude
        self._place_rankings[slot] = ranking
        return ranking

    def _rank_location(self, location: tuple[float, float]) -> int:
        """Ranking id of a location: sites by haversine distance, then by name (index)."""
        phi = math.radians(location[0])
        lam = math.radians(location[1])
        cos_phi = math.cos(phi)
        # hav(central angle) grows with the great-circle distance: compare it, skip the asin
        hav = [
            math.sin((site_phi - phi) / 2.0) ** 2 + cos_phi * site_cos * math.sin((site_lam - lam) / 2.0) ** 2
            for site_phi, site_lam, site_cos in self._trig
        ]
        order = tuple(sorted(range(self._count), key=lambda i: (hav[i], i)))
        found = self._ranking_ids.get(order)
        if found is None:
            found = len(self._orders)
            self._ranking_ids[order] = found
            self._orders.append(order)
            self._leaf_summaries.append(self._order_summary(order))
        return found

    def _order_summary(self, order: tuple[int, ...]) -> int:
        count = self._count
        summary = self._located
        for i, before in enumerate(order):
            for after in order[i + 1 :]:
                summary |= 1 << (before * count + after)
        return summary

    def _requirement(self, ranking: int, mask: int, mode: int) -> tuple[object, int, int]:
        """(answer, must, required) for a client leaf's ranking and a candidate mask."""
        key = (ranking, mask, mode)
        found = self._requirements.get(key)
        if found is not None:
            return found
        if ranking == _UNLOCATED_RANKING:
            requirement: tuple[object, int, int] = (None, self._located, 0)
        else:
            count = self._count
            chosen = [site for site in self._orders[ranking] if mask >> site & 1]
            required = 0
            pairs = 1 if mode == _FIRST else len(chosen)
            for i in range(pairs):
                for after in chosen[i + 1 :]:
                    required |= 1 << (chosen[i] * count + after)
            answer: object = self._names[chosen[0]] if mode == _FIRST else tuple(self._names[site] for site in chosen)
            requirement = (answer, required | self._unlocated, required)
        if len(self._requirements) >= self.MAX_REQUIREMENTS:
            self._requirements.clear()
        self._requirements[key] = requirement
        return requirement


class _DifferentAnswerError(Exception):
    """A leaf below answers differently (internal)."""


class _OutOfWorkError(Exception):
    """The call's work budget ran out, or the tree is deeper than an address (internal)."""


def _mix(value: int) -> int:
    """Scrambled bits (a multiplicative hash) to steer probes down varied paths."""
    return ((value + 1) * 0x9E3779B97F4A7C15F39CC0605CEDC835) & _ALL_ONES


def _mapped_floor(value: int) -> int:
    """The narrowest prefix length at which a network around this (non-mapped) IPv6 address no
    longer contains ``::ffff:0:0/96``: one more than the first bit it differs from it."""
    differing = (value >> 32) ^ _MAPPED_PREFIX_BITS
    return 96 - differing.bit_length() + 1
