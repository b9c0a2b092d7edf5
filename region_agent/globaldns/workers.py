"""``dns.workers``: N processes answering DNS on one address and port, kept in step by deltas.

With ``dns.workers`` 1 (the default) the agent answers in its own process, as always. With N > 1 the
main process opens no DNS socket: it compiles the zone as before and N worker processes
(``region_agent.globaldns.worker_main``, started with ``subprocess``) answer, each with its own UDP
socket and TCP listener on every listen address, bound with ``SO_REUSEPORT`` (the kernel spreads flows
by their address and port hash). ``SO_REUSEADDR`` stays off: Linux lets a socket join a
``SO_REUSEPORT`` group only under the same effective uid as the sockets already there (root too), so a
process under another uid still can not bind beside the agent and take part of its queries.

**Deltas.** Every set of tables the main process installs is a generation (1, 2, ...). For each
worker the main process remembers the tables it last sent, and sends the difference to the newest:
the nodes (``tables.Node``, everything answered for one owner name) that are not the same object
any more, in pickled chunks of ``CHUNK_NODES``, then one closing message with the names removed and
what the rest of the tables are made of (apex, serial, empty non-terminals, the zone config and the
regions, from which the worker makes the negative answers itself). Unchanged projects keep their
node object from one compilation to the next, so a health flip sends one node. A worker starts with
a snapshot (the difference from nothing) and binds its sockets once it is in; if the main process has
no tables yet (its first compile failed) the worker binds at once and answers SERVFAIL until its first
snapshot, as one process does before its first tables, so the start does not wait for a zone.
Encoding yields to the loop every ``SLICE_SECONDS``: a full snapshot of 10,000 projects never holds
the main loop. A generation is pickled once for all the
workers that are at the same base. A worker applies a delta only on top of the generation it is based
on and never one older than what it has; it acknowledges each; one that has not caught up within
``LAG_SECONDS`` is a problem (degraded). A delta on a generation the worker does not have (a bug, not
a normal event) is ignored and the worker asks for a snapshot (``resync``); the main process sends it
the difference from nothing next, counted in ``region_agent_dns_worker_resyncs_total{worker}`` and
logged (the first, then every 100th); the worker answers from the tables it has until it is in.
GeoIP: a ``ProximityMap`` is not sent; the worker opens the same database file and builds its own
(until then, proximity names answer every healthy address).

**UPDATE** (ACME, and TSIG-signed queries) must reach the main process's store, so a worker forwards
such a message over a second socket pair, tagged with a token, and goes on answering; the main
process's answer comes back with the token and is sent then (``worker_main.Forwarder``). UDP: from
the listening socket to the client's address and port; at most ``FORWARDS_IN_FLIGHT`` wait per worker
(one more gets SERVFAIL at once), and one the main process has not answered within
``FORWARD_TIMEOUT`` is dropped (the client retries), counted by reason in
``region_agent_dns_worker_forward_drops_total``. TCP: the same, with the answer written
on its connection when it comes (``server.TcpProtocol.later``: RFC 7766 lets answers on one connection
come out of order), so no forward holds the worker. Forwards are rare (a handful per
certificate) and charged to a per-worker budget before they are sent, so junk UPDATEs cost a worker a
12-byte REFUSED, not a round trip. That budget is one process's divided by N (``forward_budget``:
``acme.updates_per_second`` / N a second, a burst of 2 × that / N, at least 1), so all the workers
together forward no more than one process takes; the main process's own budgets (by key, source and
unverified) then apply as with one process. One client's UPDATEs from one source port reach one
worker, so a single client gets 1/N of the budget (a certificate's few UPDATEs fit).

**Per-worker limits.** Each worker has its own response rate limiter (``dns.rrl``) buckets and memo.
The kernel picks the socket of a ``SO_REUSEPORT`` group by a hash of the flow (source and destination
address and port), so the queries of one source address *and port* all go to one worker (until the
group changes: a worker exiting or starting rehashes flows) and are limited as by one process. A
resolver varies its source port per query (RFC 5452), and so does a spoofed reflection flood, so their
queries spread over the workers: a client network gets up to N times the ``dns.rrl`` rates in total
(each worker allows it the full rate).

**Supervision.** A worker that exits is restarted after a backoff (``RESTART_BACKOFF``, doubling; reset
after ``STABLE_SECONDS`` up), counted in ``region_agent_dns_worker_restarts_total{worker}`` and shown in
``/health/region`` problems while down. Its last counters are kept, so the DNS counters summed over
the workers never go back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from region_agent.globaldns.geoip.proximity import ProximityMap
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.server import BindError
from region_agent.globaldns.settings import DnsSettings
from region_agent.globaldns.tables import ZoneTables

logger = logging.getLogger("region_agent.dns.workers")
FRAME = struct.Struct("!I")
CHUNK_NODES = 500           # nodes per pickled message (~3 ms to pickle)
SLICE_SECONDS = 0.005       # the encoder yields to the loop this often
LAG_SECONDS = 5.0           # a worker this long behind the newest tables is a problem
FORWARD_TIMEOUT = 2.0       # a forward not answered by the main process this long after is dropped
FORWARDS_IN_FLIGHT = 16     # forwards one worker has waiting for the main process's answer
START_TIMEOUT = 60.0        # a worker's first snapshot applied and its sockets bound
RESTART_BACKOFF = (0.2, 30.0)
STABLE_SECONDS = 60.0
STATS_INTERVAL = 0.5        # workers report their counters this often
MAX_UNSENT = 256 << 20      # bytes queued to one worker before it is restarted (it is not reading)
UpdateHandler = Callable[..., bytes | None]


def forward_budget(settings: DnsSettings) -> tuple[float, float]:
    """One worker's UPDATE forward budget (per second, burst): one process's (``acme.updates_per_second``,
    burst twice that, as ``service.acme_updates``) divided by the workers, so together they forward what
    one process would take; the burst is at least one UPDATE per worker."""
    per_second, workers = settings.acme.updates_per_second, max(1, settings.workers)
    return per_second / workers, max(1.0, max(1, int(per_second * 2)) / workers)


def frame(message: object, locator: object = None, token: int = 0) -> bytes:
    """One length-prefixed pickled message; ``locator`` (a ProximityMap) is sent as a reference."""
    buffer = io.BytesIO()
    buffer.write(b"\0\0\0\0")
    pickler = _Pickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.locator, pickler.token = locator, token
    pickler.dump(message)
    data = buffer.getbuffer()
    FRAME.pack_into(data, 0, len(data) - 4)
    return bytes(data)


class _Pickler(pickle.Pickler):
    locator: object = None
    token = 0

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, ProximityMap):
            return ("locator", self.token if obj is self.locator else -1)
        return None


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    (length,) = FRAME.unpack(await reader.readexactly(4))
    return await reader.readexactly(length)


@dataclass
class Slot:
    """One worker: its process now, what it was sent and has confirmed, and its history."""

    index: int
    process: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    ready: asyncio.Future[list[tuple[str, int]]] | None = None
    sent: ZoneTables | None = None        # the tables it was last sent (None: nothing yet)
    sent_gen = 0
    acked_gen = 0
    geo_token = 0
    withheld_sent: bool | None = None
    behind_since: float | None = None
    counters: DnsCounters | None = None   # its last report
    forwards: dict[str, int] = field(default_factory=dict)  # its forwards by outcome (its last report)
    retired_forwards: collections.Counter[str] = field(default_factory=collections.Counter)
    retired: DnsCounters = field(default_factory=DnsCounters)  # what its earlier processes answered
    restarts = 0
    resyncs = 0                           # snapshots sent because a delta did not apply (its processes summed)
    resynced_through = 0                  # what it was sent before the last such snapshot: later asks repeat it
    down_since: float | None = None
    last_exit: int | None = None
    started_at = 0.0

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def answers(self) -> int:
        return self.retired.total() + (0 if self.counters is None else self.counters.total())


class DnsWorkers:
    """Starts, feeds and supervises the worker processes of one :class:`ZoneService`."""

    def __init__(self, settings: DnsSettings, updates: Callable[[], UpdateHandler | None]) -> None:
        self.settings = settings
        self.count = settings.workers
        self.port = settings.port
        self._updates = updates  # the main process's UPDATE handler, asked at each forward (None: NOTIMP)
        self.slots = [Slot(i) for i in range(self.count)]
        self.gen = 0
        self.latest: ZoneTables | None = None
        self.withheld = False
        self.forwarded = 0
        self.forward_errors = 0   # forwarded UPDATEs whose handler raised
        self.feed_failure: str | None = None   # why the last feed of the tables failed, while it does
        self._geo_locator: object = None
        self._geo_token = 0
        self._geo_message: tuple[Any, ...] = ("geo", 0, None, ())
        self._wake = asyncio.Event()
        self._publisher: asyncio.Task[None] | None = None
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = False
        self.bound: list[tuple[str, int]] = []
        self.generation_changed = asyncio.Event()  # set whenever a worker confirms a generation

    # --- what the zone service calls ------------------------------------------------------------

    def publish(self, tables: ZoneTables) -> None:
        """Newest tables: sent to every worker as a delta, soon (never waits)."""
        self.gen += 1
        self.latest = tables
        now = time.monotonic()
        for slot in self.slots:
            if slot.behind_since is None and slot.writer is not None:
                slot.behind_since = now
        self._wake.set()

    def set_withheld(self, withheld: bool) -> None:
        self.withheld = withheld
        self._wake.set()

    def in_step(self) -> bool:
        """Every worker answers from the newest tables (and withheld state)."""
        return all(s.writer is not None and s.acked_gen == self.gen and s.withheld_sent == self.withheld
                   for s in self.slots)

    async def start(self) -> None:
        """Start every worker and wait until each has applied the snapshot and bound its sockets.

        Port 0 (tests, benches): the main process picks one, holding it while the workers bind.
        Raises :class:`WorkerStartError` (a :class:`BindError`: the line the CLI prints, exit 2).
        """
        reservations = self._reserve_ports()
        try:
            self._publisher = asyncio.get_running_loop().create_task(self._publish_loop(), name="dns workers feed")
            starts = [self._spawn(slot) for slot in self.slots]
            results = await asyncio.gather(*starts, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                await self.stop()
                raise errors[0]
            self.bound = results[0]  # type: ignore[assignment]
        finally:
            for sock in reservations:
                sock.close()
        self._supervisors = [asyncio.get_running_loop().create_task(self._supervise(slot), name=f"dns worker {i}")
                             for i, slot in enumerate(self.slots)]
        logger.info("DNS answered by %d worker processes (pids %s) on %s", self.count,
                    ", ".join(str(s.pid) for s in self.slots), ", ".join(f"{h} port {p}" for h, p in self.bound))

    async def stop(self) -> None:
        self._stopping = True
        for task in [*self._supervisors, *([self._publisher] if self._publisher else [])]:
            task.cancel()
        for task in [*self._supervisors, *([self._publisher] if self._publisher else [])]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._supervisors.clear()
        self._publisher = None
        await asyncio.gather(*(self._end(slot) for slot in self.slots))

    # --- health ---------------------------------------------------------------------------------

    def problems(self) -> tuple[str, ...]:
        now = time.monotonic()
        lines = []
        for slot in self.slots:
            if slot.down_since is not None:
                lines.append(f"dns worker {slot.index} down for {now - slot.down_since:.1f} s (exit {slot.last_exit}, "
                             f"restarted {slot.restarts} times); the other workers answer its share")
            elif slot.behind_since is not None and now - slot.behind_since > LAG_SECONDS:
                lines.append(f"dns worker {slot.index} (pid {slot.pid}) answers zone generation {slot.acked_gen}, "
                             f"{self.gen - slot.acked_gen} behind for {now - slot.behind_since:.1f} s")
        if self.feed_failure is not None:
            lines.append(f"dns workers: feeding the tables failed ({self.feed_failure}); they answer the last they got")
        return tuple(lines)

    def answers_by_worker(self) -> list[int]:
        """Responses each worker has sent, its earlier processes included."""
        return [slot.answers() for slot in self.slots]

    # --- processes ------------------------------------------------------------------------------

    def _reserve_ports(self) -> list[socket.socket]:
        """For port 0, one free port for all (UDP and TCP reserved with SO_REUSEPORT until the workers bind)."""
        if self.settings.port != 0:
            self.port = self.settings.port
            return []
        for _attempt in range(20):
            held: list[socket.socket] = []
            try:
                port = 0
                for host in self.settings.listen_addresses:
                    family = socket.AF_INET6 if ":" in host else socket.AF_INET
                    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                        sock = socket.socket(family, kind)
                        held.append(sock)
                        if family == socket.AF_INET6:
                            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                        sock.bind((host, port))
                        port = sock.getsockname()[1]
                self.port = port
                return held
            except OSError:
                for sock in held:
                    sock.close()
        raise OSError("no free port for the DNS workers")

    async def _spawn(self, slot: Slot) -> list[tuple[str, int]]:
        """Start ``slot``'s process, feed it, and return its bound addresses once it answers."""
        loop = asyncio.get_running_loop()
        feed, theirs = socket.socketpair()
        upd, upd_theirs = socket.socketpair()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "region_agent.globaldns.worker_main", str(theirs.fileno()),
                str(upd_theirs.fileno()), pass_fds=(theirs.fileno(), upd_theirs.fileno()),
                stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            upd_theirs.close()
        reader, writer = await asyncio.open_connection(sock=feed)
        upd_reader, upd_writer = await asyncio.open_connection(sock=upd)
        slot.process, slot.writer = process, writer
        slot.resynced_through = 0
        slot.sent, slot.sent_gen, slot.acked_gen, slot.geo_token, slot.withheld_sent = None, 0, 0, 0, self.withheld
        slot.counters, slot.behind_since, slot.started_at = None, time.monotonic(), time.monotonic()
        slot.ready = loop.create_future()
        settings = self.settings.model_copy(update={"port": self.port})
        # No tables yet (the first compile failed): the worker binds now and answers SERVFAIL until they come.
        writer.write(frame(("hello", slot.index, settings, self._updates() is not None, self.withheld,
                            self.latest is None)))
        slot.tasks = [loop.create_task(self._listen(slot, reader), name=f"dns worker {slot.index} reports"),
                      loop.create_task(self._serve_updates(upd_reader, upd_writer),
                                       name=f"dns worker {slot.index} updates")]
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(slot.ready), START_TIMEOUT)
        except TimeoutError:
            raise WorkerStartError(f"dns.workers: worker {slot.index} did not start within {START_TIMEOUT:.0f} s") \
                from None

    async def _listen(self, slot: Slot, reader: asyncio.StreamReader) -> None:
        """What the worker reports: ready, bind errors, acknowledgements, counters."""
        try:
            while True:
                message = pickle.loads(await read_frame(reader))
                kind = message[0]
                if kind == "ack":
                    slot.acked_gen = message[1]
                    if slot.acked_gen == self.gen:
                        slot.behind_since = None
                    self.generation_changed.set()
                elif kind == "resync":
                    self._resync(slot, message[1], message[2])
                elif kind == "stats":
                    slot.counters, slot.forwards = message[1], message[2]
                elif kind == "ready" and slot.ready is not None and not slot.ready.done():
                    slot.ready.set_result([tuple(a) for a in message[1]])
                    slot.down_since = None
                elif kind == "bind_error" and slot.ready is not None and not slot.ready.done():
                    slot.ready.set_exception(WorkerStartError(message[1]))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the process is gone: the supervisor sees it exit
        except Exception as error:
            logger.error("dns worker %d sent a report that could not be read (%r): restarting it", slot.index, error)
            if slot.process is not None and slot.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.kill()
        finally:
            if slot.ready is not None and not slot.ready.done():
                slot.ready.set_exception(WorkerStartError(f"dns.workers: worker {slot.index} exited while starting"))

    def _resync(self, slot: Slot, rejected: int, has: int) -> None:
        """The worker could not apply delta ``rejected`` (it has generation ``has``): a snapshot next.

        It answers from what it has meanwhile. Asks for deltas sent before the snapshot repeat this one.
        """
        if rejected <= slot.resynced_through or slot.writer is None:
            return
        slot.resyncs += 1
        slot.resynced_through = slot.sent_gen
        if slot.resyncs == 1 or slot.resyncs % 100 == 0:
            logger.warning("dns worker %d could not apply generation %d (it has %d): sending it a snapshot "
                           "(%d times so far)", slot.index, rejected, has, slot.resyncs)
        slot.sent, slot.sent_gen = None, 0   # the difference from nothing, at the next round
        self._wake.set()

    async def _serve_updates(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """UPDATEs and signed queries forwarded by a worker, answered by the main process's handler."""
        try:
            while True:
                request_id, data, source, tcp, our_payload = pickle.loads(await read_frame(reader))
                handler = self._updates()
                try:
                    out = None if handler is None else handler(data, source, tcp=tcp, our_payload=our_payload)
                except Exception:  # a bug must cost one UPDATE, never the worker's forwarding
                    self.forward_errors += 1
                    if self.forward_errors == 1 or self.forward_errors % 1000 == 0:
                        logger.exception("error answering a forwarded UPDATE (%d so far)", self.forward_errors)
                    out = None
                self.forwarded += 1
                writer.write(frame((request_id, out)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _supervise(self, slot: Slot) -> None:
        """Wait for the process to exit; restart it after a backoff, counted."""
        backoff = RESTART_BACKOFF[0]
        while True:
            assert slot.process is not None
            code = await slot.process.wait()
            if self._stopping:
                return
            self._retire(slot, code)
            logger.error("dns worker %d (pid %s) exited with %s; restarting in %.1f s", slot.index, slot.pid, code,
                         backoff)
            if time.monotonic() - slot.started_at > STABLE_SECONDS:
                backoff = RESTART_BACKOFF[0]
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF[1])
            slot.restarts += 1
            try:
                await self._spawn(slot)
                logger.info("dns worker %d restarted (pid %s)", slot.index, slot.pid)
            except Exception as error:
                logger.error("dns worker %d did not restart: %r", slot.index, error)
                if slot.process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        slot.process.kill()

    def _retire(self, slot: Slot, code: int) -> None:
        slot.down_since = slot.down_since or time.monotonic()
        slot.last_exit = code
        if slot.counters is not None:
            _add(slot.retired, slot.counters)
            slot.counters = None
        slot.retired_forwards.update(slot.forwards)
        slot.forwards = {}
        for task in slot.tasks:
            task.cancel()
        if slot.writer is not None:
            slot.writer.close()
        slot.writer, slot.sent, slot.behind_since = None, None, None

    async def _end(self, slot: Slot) -> None:
        process = slot.process
        if slot.writer is not None:
            slot.writer.close()  # EOF: the worker closes its sockets and exits
        for task in slot.tasks:
            task.cancel()
        if process is None or process.returncode is not None:
            return
        try:
            await asyncio.wait_for(process.wait(), 2.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            await process.wait()

    # --- the feed -------------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._publish_once()
                self.feed_failure = None
            except Exception as error:
                if self.feed_failure is None:
                    logger.exception("dns workers: feeding the tables failed; retrying at the next change")
                self.feed_failure = repr(error)[:300]

    async def _publish_once(self) -> None:
        target, gen = self.latest, self.gen
        if target is None:
            return
        self._refresh_geo(target)
        pending = [s for s in self.slots if s.writer is not None and s.sent_gen != gen]
        by_base: dict[int, list[Slot]] = {}
        for slot in pending:
            by_base.setdefault(slot.sent_gen, []).append(slot)
        for base_gen, group in by_base.items():
            base = group[0].sent
            frames = await self._encode(base, base_gen, target, gen)
            for slot in group:
                if slot.writer is None or slot.sent_gen != base_gen:
                    continue  # restarted meanwhile: the next round sends it a snapshot
                if slot.geo_token != self._geo_token:
                    slot.writer.write(frame(self._geo_message))
                    slot.geo_token = self._geo_token
                for data in frames:
                    slot.writer.write(data)
                slot.sent, slot.sent_gen = target, gen
                self._check_backlog(slot)
        for slot in self.slots:
            if slot.writer is not None and slot.withheld_sent != self.withheld and slot.sent_gen:
                slot.writer.write(frame(("withhold", self.withheld)))
                slot.withheld_sent = self.withheld
        if self.gen != gen:
            self._wake.set()

    def _check_backlog(self, slot: Slot) -> None:
        transport = None if slot.writer is None else slot.writer.transport
        if transport is not None and transport.get_write_buffer_size() > MAX_UNSENT and slot.process is not None:
            logger.error("dns worker %d is not reading its feed; restarting it", slot.index)
            with contextlib.suppress(ProcessLookupError):
                slot.process.kill()

    async def _encode(self, base: ZoneTables | None, base_gen: int, target: ZoneTables, gen: int) -> list[bytes]:
        """The frames taking a worker from ``base`` (generation ``base_gen``; None: nothing) to ``target``."""
        deadline = time.perf_counter() + SLICE_SECONDS
        old = base.nodes if base is not None else {}
        changed: list[tuple[bytes, object]] = []
        for count, (owner, node) in enumerate(target.nodes.items(), 1):
            if old.get(owner) is not node:
                changed.append((owner, node))
            if count % 2048 == 0 and time.perf_counter() > deadline:
                await asyncio.sleep(0)
                deadline = time.perf_counter() + SLICE_SECONDS
        removed = [owner for owner in old if owner not in target.nodes]
        frames = []
        locator, token = self._geo_locator, self._geo_token
        for start in range(0, len(changed), CHUNK_NODES):
            frames.append(frame(("nodes", gen, base_gen, dict(changed[start:start + CHUNK_NODES])), locator, token))
            if time.perf_counter() > deadline:
                await asyncio.sleep(0)
                deadline = time.perf_counter() + SLICE_SECONDS
        config, regions = _basis(target)
        frames.append(frame(("tables", gen, base_gen, removed, target.apex, target.serial, target.empty_nonterminals,
                             target.challenge_owners, config, regions), locator, token))
        return frames

    def _refresh_geo(self, tables: ZoneTables) -> None:
        basis = tables.basis
        locator = basis[2] if isinstance(basis, tuple) and len(basis) > 2 else None
        if locator is self._geo_locator:
            return
        self._geo_locator = locator
        self._geo_token += 1
        if isinstance(locator, ProximityMap):
            database = locator._db
            self._geo_message = ("geo", self._geo_token, None if database is None else database.path,
                                 locator._sites)
        else:
            self._geo_message = ("geo", self._geo_token, None, ())


def _basis(tables: ZoneTables) -> tuple[object, dict[str, object]]:
    """The zone config and regions the tables were compiled with (``ZoneBuild``'s basis)."""
    basis = tables.basis
    if not isinstance(basis, tuple) or len(basis) < 4:
        raise ValueError("tables without a compile basis can not be sent to workers")
    return basis[0], dict(basis[3])


def _add(total: DnsCounters, part: DnsCounters) -> None:
    """Add ``part``'s counts into ``total`` (the counters of a worker that exited)."""
    for key, count in part.answers.items():
        total.answers[key] += count
    total.malformed_reasons.update(part.malformed_reasons)
    total.latency_counts = [a + b for a, b in zip(total.latency_counts, part.latency_counts, strict=True)]
    total.latency_sum += part.latency_sum
    total.memo_hits += part.memo_hits
    total.answer_errors += part.answer_errors
    total.rrl_actions = [a + b for a, b in zip(total.rrl_actions, part.rrl_actions, strict=True)]
    total.tcp_connections += part.tcp_connections
    total.tcp_refused.update(part.tcp_refused)
    total.tcp_closed.update(part.tcp_closed)
    total.tcp_read_pauses.update(part.tcp_read_pauses)


class MergedCounters(DnsCounters):
    """The main process's counters plus every worker's (now and before a restart), built at scrape time."""

    def __init__(self, main: DnsCounters, workers: DnsWorkers) -> None:
        self._main, self._workers = main, workers

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_") or name not in _SUMMED:
            return object.__getattribute__(self, name)
        main: DnsCounters = object.__getattribute__(self, "_main")
        if name in ("zone_serial", "zone_reloads", "zone_errors"):
            return getattr(main, name)
        total = DnsCounters()
        _add(total, main)
        total.tcp_open = main.tcp_open
        for slot in object.__getattribute__(self, "_workers").slots:
            _add(total, slot.retired)
            if slot.counters is not None:
                _add(total, slot.counters)
                total.tcp_open += slot.counters.tcp_open
        return getattr(total, name)


_SUMMED = frozenset(DnsCounters().__dict__)


class WorkersCollector(Collector):
    def __init__(self, workers: DnsWorkers) -> None:
        self.workers = workers

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        slots = self.workers.slots
        yield GaugeMetricFamily("region_agent_dns_workers_up", "DNS worker processes answering now (dns.workers)",
                                sum(1 for s in slots if s.down_since is None and s.writer is not None))
        restarts = CounterMetricFamily("region_agent_dns_worker_restarts", "Times a DNS worker process was "
                                       "restarted after it exited", labels=["worker"])
        answers = CounterMetricFamily("region_agent_dns_worker_responses", "DNS responses sent by each worker "
                                      "process (its earlier processes included)", labels=["worker"])
        lag = GaugeMetricFamily("region_agent_dns_worker_generation_lag", "Zone generations a worker is behind "
                                "the main process's newest tables", labels=["worker"])
        resyncs = CounterMetricFamily("region_agent_dns_worker_resyncs", "Full snapshots sent to a worker because "
                                      "a delta did not apply to the generation it had", labels=["worker"])
        for slot in slots:
            resyncs.add_metric([str(slot.index)], slot.resyncs)
            restarts.add_metric([str(slot.index)], slot.restarts)
            answers.add_metric([str(slot.index)], slot.answers())
            lag.add_metric([str(slot.index)], self.workers.gen - slot.acked_gen)
        yield restarts
        yield resyncs
        yield answers
        yield lag
        yield CounterMetricFamily("region_agent_dns_worker_forwarded_updates", "UPDATEs and signed queries a "
                                  "worker forwarded to the main process", self.workers.forwarded)
        dropped = CounterMetricFamily("region_agent_dns_worker_forward_drops", "Forwards of UPDATEs and signed "
                                      "queries a worker gave up: timeout (no answer in time; UDP: not answered), "
                                      "busy (too many in flight: SERVFAIL), late (answered after the timeout)",
                                      labels=["reason"])
        for reason in ("timeout", "busy", "late"):
            dropped.add_metric([reason], sum(s.forwards.get(reason, 0) + s.retired_forwards[reason] for s in slots))
        yield dropped


class WorkerStartError(BindError):
    """A worker could not bind or start: one line for the operator (the CLI exits 2)."""

    def __init__(self, line: str) -> None:
        OSError.__init__(self, None, line)
        self.line = line
        self.setting = "dns.workers"

    def __str__(self) -> str:
        return self.line


async def wait_until(condition: Callable[[], bool], changed: asyncio.Event, timeout: float) -> None:
    """Return when ``condition()`` holds, woken by ``changed``; TimeoutError after ``timeout``."""
    async def wait() -> None:
        while not condition():
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 0.05)
    await asyncio.wait_for(wait(), timeout)

