"""The DNS side of the agent: compile on every state change, answer on UDP and TCP.

:class:`ZoneService` listens to the store; a burst of changes (a zone file reload, a
gossip push-pull) is coalesced into one compilation on the next loop turn, and the new
tables replace the old ones in one assignment, so a query sees either the old zone or the
new one, never a mix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from region_agent.base.gc_pause import freeze_survivors, gc_paused
from region_agent.globaldns.acme.service import AcmeConfig, AcmeUpdates
from region_agent.globaldns.acme.tsig_keys import TsigKeysWatcher, build_keyring, inline_keys
from region_agent.globaldns.acme.update import UpdateLimits
from region_agent.globaldns.answer import Responder, ResponderLimits
from region_agent.globaldns.answer_state import AnswerStateCollector
from region_agent.globaldns.compiler import CompileReport, ZoneBuild, ZoneConfig, compile_zone
from region_agent.globaldns.geoip.proximity import GeoDatabase, ProximityMap, Site
from region_agent.globaldns.geoip.source import GeoipSource
from region_agent.globaldns.metrics import DnsCounters, register
from region_agent.globaldns.rrl import RateLimiter, RrlConfig
from region_agent.globaldns.server import DnsServer, TcpLimits
from region_agent.globaldns.settings import DnsSettings, RrlSettings
from region_agent.globaldns.tables import Locator, ZoneHolder, ZoneTables
from region_agent.globaldns.workers import DnsWorkers, MergedCounters, WorkersCollector
from region_agent.state.model import ACME, Kind, Region, role_writer
from region_agent.state.observations import Observations, ObservedState
from region_agent.state.store import OUTSIDE_THE_ZONE, Entry, StateView, Store

logger = logging.getLogger("region_agent.dns")
# A compilation yields to the loop this often: a full recompile of 10,000 projects (a region
# or GeoIP change) takes most of a second, and queries must not wait for it.
COMPILE_SLICE_SECONDS = 0.01
FREEZE_AFTER_PROJECTS = 1000


def zone_config(settings: DnsSettings) -> ZoneConfig:
    return ZoneConfig(
        apex=settings.zone, record_ttl=settings.record_ttl, ns_ttl=settings.ns_ttl, soa_ttl=settings.soa_ttl,
        soa_mname=settings.soa_mname, hostmaster=settings.hostmaster, refresh=settings.soa_refresh,
        retry=settings.soa_retry, expire=settings.soa_expire, minimum=settings.soa_minimum,
        startup_answer=settings.startup_answer,
    )


def tcp_limits(settings: DnsSettings) -> TcpLimits:
    return TcpLimits(idle_timeout=settings.tcp_idle_timeout, message_timeout=settings.tcp_message_timeout,
                     max_connections=settings.tcp_max_connections,
                     max_per_source=settings.tcp_max_connections_per_source,
                     write_buffer=settings.tcp_write_buffer, max_in_flight=settings.tcp_max_in_flight)


def rate_limiter(settings: RrlSettings) -> RateLimiter | None:
    """The UDP response rate limiter, or None while it is off (``responses_per_second`` 0)."""
    rate = settings.responses_per_second
    if not rate:
        return None
    return RateLimiter(RrlConfig(
        responses_per_second=rate, nxdomains_per_second=settings.nxdomains_per_second or rate,
        errors_per_second=settings.errors_per_second or rate, window=settings.window, slip=settings.slip,
        ipv4_prefix=settings.ipv4_prefix, ipv6_prefix=settings.ipv6_prefix, max_buckets=settings.max_buckets))


def acme_updates(settings: DnsSettings, store: Store, holder: ZoneHolder,
                 registry: CollectorRegistry) -> AcmeUpdates | None:
    """RFC 2136 UPDATE of ACME challenges, or None while neither a TSIG key nor a keys file is configured.

    Raises :class:`TsigConfigError` (naming the key) for a key that can not be used.
    """
    acme = settings.acme
    specs = inline_keys(acme)
    if not specs and acme.tsig_keys_file is None:
        return None  # with a keys file UPDATE is on even while it holds no key: keys may come without a restart
    keyring = build_keyring(specs, acme.tsig_keys_file)
    config = AcmeConfig(
        apex=settings.zone, keyring=keyring, writer=role_writer(store.writer, ACME),
        limits=UpdateLimits(acme.max_value_length, acme.max_records_per_name, acme.max_records),
        lifetime=acme.record_lifetime, updates_per_second=acme.updates_per_second,
        burst=max(1, int(acme.updates_per_second * 2)))
    return AcmeUpdates(store, holder, config, registry)


class ZoneService:
    def __init__(self, settings: DnsSettings, store: Store, registry: CollectorRegistry,
                 observations: Observations | None = None) -> None:
        """``observations``: this agent's own checks of copies, laid over the store's reports."""
        self.settings = settings
        self.store = store
        self.view: StateView = store if observations is None else ObservedState(store, observations)
        self.config = zone_config(settings)
        self.holder = ZoneHolder()
        self._withheld = False
        self._latest: ZoneTables | None = None   # the newest compiled tables, installed or withheld
        self.counters = DnsCounters()
        # dns.workers > 1: worker processes answer (region_agent.globaldns.workers); this process compiles,
        # answers UPDATEs they forward, and counts what they report.
        self.workers: DnsWorkers | None = None
        if settings.workers > 1:
            self.workers = DnsWorkers(settings, lambda: None if self.acme is None else self.acme.handle)
            register(MergedCounters(self.counters, self.workers), registry)
            registry.register(WorkersCollector(self.workers))
        else:
            register(self.counters, registry)
        registry.register(AnswerStateCollector(lambda: self._latest))   # withheld too: what it would answer
        self.responder = Responder(self.holder, self.counters, ResponderLimits(
            our_payload=settings.udp_payload, memo_entries=settings.response_memo_entries),
            rate_limiter(settings.rrl))
        self.server = DnsServer(self.responder, [(a, settings.port) for a in settings.listen_addresses],
                                tcp_limits(settings))
        self._challenges_changed = False  # ACME records changed since the last compilation
        self.acme = acme_updates(settings, store, self.holder, registry)
        if self.acme is not None:
            self.responder.updates = self.acme.handle
        # Re-reads dns.acme.tsig_keys_file when it changes (the agent spawns its run()); None without a file.
        keys_file = settings.acme.tsig_keys_file
        self.tsig_keys = (None if self.acme is None or keys_file is None else
                          TsigKeysWatcher(keys_file, inline_keys(settings.acme), self.acme, registry))
        self.health_known = False
        self.locator: Locator | None = None
        self._geo_database: GeoDatabase | None = None
        self._sites: tuple[Site, ...] | None = None
        self._warm: asyncio.Task[None] | None = None
        self._pending: asyncio.Task[None] | None = None  # a compilation running or about to
        self._compile_failure: str | None = None  # why the last compilation failed (the previous zone answers)
        self._left_out: tuple[str, ...] = ()  # names the newest tables leave out: not DNS names
        self._changed_projects: set[str] | None = set()  # None: compile everything
        self.changed = asyncio.Event()  # set after every swap, for whoever publishes views
        # Where the GeoIP database comes from; its run() (the agent spawns it) keeps it fresh.
        self.geoip = GeoipSource(settings.geoip, settings.geoip_database, registry,
                                 install=self.replace_geo_database, on_status=self.changed.set)
        store.subscribe(self._on_change)
        if observations is not None:
            observations.subscribe(self._on_observation)

    @property
    def tables(self) -> ZoneTables | None:
        return self.holder.tables

    def set_health_known(self) -> None:
        """Answer from health from now on (a full compilation; await :meth:`compiled` for it)."""
        if not self.health_known:
            self.health_known = True
            self._changed_projects = None
            if self._latest is not None:  # before start(), start() compiles
                self._schedule()

    def _on_change(self, entries: list[Entry]) -> None:
        entries = [e for e in entries if e.key[0] not in OUTSIDE_THE_ZONE]   # identities, idempotency records
        if not entries:
            return
        if self._changed_projects is not None:
            for entry in entries:
                if entry.key[0] in (Kind.PROJECT.value, Kind.COPY.value):
                    self._changed_projects.add(entry.key[1])
                elif entry.key[0] == Kind.ACME.value:
                    self._challenges_changed = True  # every compilation rebuilds them; no project changes
                else:
                    self._changed_projects = None  # a region: the compiler redoes everything anyway
                    break
        self._schedule()

    def _on_observation(self, copies: list[tuple[str, str]]) -> None:
        if self._changed_projects is not None:
            self._changed_projects.update(slug for slug, _region in copies)
        self._schedule()

    def _schedule(self) -> None:
        """Compile on the next loop turn, so a burst of changes costs one compilation."""
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_task(self._compile_pending(), name="zone compile")

    async def _compile_pending(self) -> None:
        """Compile in slices of ``COMPILE_SLICE_SECONDS`` until no change is left.

        Between slices the loop answers queries from the previous tables; changes that
        arrive meanwhile are compiled by the next round (a region change: all of them).
        """
        try:
            # Not in the loop turn of the write that asked for it: that turn has done its share.
            await asyncio.sleep(0)
            with gc_paused():  # no full collection in the middle of a slice (see region_agent.base.gc_pause)
                compiled = await self._compile_rounds()
                if compiled >= FREEZE_AFTER_PROJECTS:
                    freeze_survivors()  # the new tables: no later collection needs to scan them
        except Exception as exc:  # any bug or bad entry: degraded, never a dead zone
            self._failed(exc)
        finally:
            self._pending = None

    async def _compile_rounds(self) -> int:
        """Compile until no change is left; the number of projects compiled."""
        compiled = 0
        while self._changed_projects is None or self._changed_projects or self._challenges_changed:
            changed, self._changed_projects = self._changed_projects, set()
            self._challenges_changed = False
            self._refresh_locator(self.store.regions)
            report = CompileReport()
            build = ZoneBuild(self.view, self.config, health_known=self.health_known, locator=self.locator,
                              report=report, previous=self._latest, changed_projects=changed)
            while not build.step(COMPILE_SLICE_SECONDS):  # noqa: ASYNC110 - not waiting: slicing
                await asyncio.sleep(0)  # one loop turn for the queries waiting
            previous = _contents(self._latest) if build.compiled >= FREEZE_AFTER_PROJECTS else []
            self._install(build.finish(), report)
            compiled += build.compiled
            await _release_in_slices(previous)
        return compiled

    def _failed(self, exc: Exception) -> None:
        """A compilation raised: the previous tables keep answering, the agent is degraded with the reason,
        and the next change compiles everything again (what this round took is not in the tables)."""
        self._changed_projects = None
        answering = "the previous zone" if self._latest is not None else "SERVFAIL (no zone compiled yet)"
        self._compile_failure = f"zone compile failed, answering {answering}: {type(exc).__name__}: {exc}"
        self.counters.zone_errors += 1
        logger.exception("zone: compile failed; the previous zone keeps answering")
        self.changed.set()  # the region's view shows the problem

    def problems(self) -> tuple[str, ...]:
        """A failed compilation, and names left out of the zone because they are not DNS names."""
        return (*(() if self._compile_failure is None else (self._compile_failure,)), *self._left_out)

    async def compiled(self) -> None:
        """Return once every change so far is in the tables being answered."""
        while self._pending is not None:
            await asyncio.shield(self._pending)

    def rebuild(self) -> None:
        """Compile the zone from the store now, in one go (at start, before the sockets open)."""
        changed, self._changed_projects = self._changed_projects, set()
        self._refresh_locator(self.store.regions)
        report = CompileReport()
        try:
            tables = compile_zone(self.view, self.config, health_known=self.health_known, locator=self.locator,
                                  report=report, previous=self._latest, changed_projects=changed)
        except Exception as exc:  # degraded (SERVFAIL without a previous zone), not dead
            self._failed(exc)
            return
        self._install(tables, report)

    def withhold(self) -> None:
        """Answer SERVFAIL to everything until :meth:`release`: a cluster agent whose store is empty while
        peers exist must not answer NXDOMAIN for live names (an empty store is not an empty zone), and one
        rejoining after a long absence must not answer from what it held (see ``gossip.sync``)."""
        self._withheld = True
        self.holder.clear()
        if self.workers is not None:
            self.workers.set_withheld(True)
        self.changed.set()

    def release(self) -> None:
        if self._withheld:
            self._withheld = False
            logger.info("zone: answering from the store now")
            if self.workers is not None:
                self.workers.set_withheld(False)
            if self._latest is not None:
                self.holder.replace(self._latest)
                self.changed.set()

    @property
    def withheld(self) -> bool:
        return self._withheld

    def _install(self, tables: ZoneTables, report: CompileReport) -> None:
        for problem in report.problems:
            logger.warning("zone: %s", problem)
        self.counters.zone_errors += len(report.problems)
        self._compile_failure = None
        self._left_out = tuple(report.left_out)
        self._latest = tables
        if self.workers is not None:
            self.workers.publish(tables)  # sent as a delta, off this call
        if self._withheld:
            self.changed.set()
            return
        self.holder.replace(tables)
        self.counters.zone_serial = tables.serial
        self.counters.zone_reloads += 1
        self.changed.set()

    def _refresh_locator(self, regions: Mapping[str, Region]) -> None:
        """A new proximity map over all located regions whenever their locations change.

        One map serves every project (each passes its healthy regions as candidates), so
        health changes keep all its precomputed work; only a change of sites rebuilds it.
        """
        if self._geo_database is None:
            return
        sites = _located_sites(regions)
        if sites == self._sites:
            return
        self._sites = sites
        proximity = ProximityMap(self._geo_database, sites)
        self.locator = proximity
        if self._warm is not None:
            self._warm.cancel()
        self._warm = asyncio.get_running_loop().create_task(_warm(proximity), name="geoip warm-up")

    async def replace_geo_database(self, database: GeoDatabase | None) -> None:
        """Answer proximity projects from ``database`` (None: without one) from now on.

        The new proximity map is built in a thread (its arrays take tens of ms for a full
        database) and swapped in by reference; the zone is then recompiled in slices like any
        change, so queries keep being answered from the old map until the new tables are in.
        """
        sites = _located_sites(self.store.regions)
        proximity = None if database is None else await asyncio.to_thread(ProximityMap, database, sites)
        if self._warm is not None:
            self._warm.cancel()
            self._warm = None
        self._geo_database, self.locator = database, proximity
        if proximity is not None:
            self._sites = sites
            self._warm = asyncio.get_running_loop().create_task(_warm(proximity), name="geoip warm-up")
        else:
            self._sites = None
        if self._latest is not None:  # before start(), start() compiles
            self._changed_projects = None
            self._schedule()
            await self.compiled()

    async def start(self) -> None:
        # Opening GeoLite2-City takes about 0.3 s (in a thread); done before the sockets open, so it
        # delays nothing. A download is left to geoip.run(): the start never waits for the network.
        await self.geoip.start()
        self.rebuild()
        if self.workers is None:
            await self.server.start()
            return
        await self.workers.start()  # this process binds no DNS socket: the workers answer
        self.server.bound.extend(self.workers.bound)

    async def stop(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.cancel()  # no compilation after the service has stopped
            with contextlib.suppress(asyncio.CancelledError):
                await pending
        if self._warm is not None:
            self._warm.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warm
        if self.workers is not None:
            await self.workers.stop()
        await self.server.stop()


def _located_sites(regions: Mapping[str, Region]) -> tuple[Site, ...]:
    return tuple(Site(r.name, r.latitude, r.longitude) for r in regions.values()
                 if r.latitude is not None and r.longitude is not None)


def _contents(tables: ZoneTables | None) -> list[dict[Any, Any]]:
    """Copies of the big maps of ``tables``: holding them, dropping the tables frees next to nothing."""
    return [] if tables is None else [dict(tables.nodes), dict(tables.projects)]


async def _release_in_slices(maps: list[dict[Any, Any]]) -> None:
    """Drop the previous tables' contents a slice at a time.

    Freeing 10,000 compiled projects in one go (the last reference to replaced tables going
    away) holds the loop ~40 ms; what the new tables share with the old stays alive anyway.
    """
    for contents in maps:
        while contents:
            deadline = time.perf_counter() + COMPILE_SLICE_SECONDS
            while contents and time.perf_counter() < deadline:
                for _ in range(min(256, len(contents))):
                    contents.popitem()
            await asyncio.sleep(0)


async def _warm(proximity: ProximityMap) -> None:
    """Precompute the map's subtree summaries in small slices between queries.

    Until it is done, clients in large uniform areas get a narrower (still correct) ECS
    scope. Each slice takes a few milliseconds; the pause between slices leaves the loop
    to the DNS server, so warming takes longer on a busy agent but never starves it.
    """
    started = time.monotonic()
    while True:
        if proximity.warm(2000):
            break
        await asyncio.sleep(0.001)
    logger.info("GeoIP proximity map warm in %.1f s", time.monotonic() - started)
