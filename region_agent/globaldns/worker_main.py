"""A DNS worker process (``dns.workers`` > 1): answers from tables fed by the main process.

Started by :mod:`region_agent.globaldns.workers` as ``python -m region_agent.globaldns.worker_main
FEED_FD UPDATES_FD``. It reads a hello (its index, the DNS settings), then generations of tables as
deltas; it binds its sockets (``SO_REUSEPORT``) once the first snapshot is in, so a restarted worker
never answers from no zone beside workers that have one. When the main process has no tables yet
(its first compile failed) the hello says so and the worker binds at once and answers SERVFAIL
(``Responder._unready``) until its first snapshot, as the agent's own process does before its first
tables. It acknowledges each generation, reports its counters every
``STATS_INTERVAL``, forwards UPDATEs to the main process, and exits when the feed ends (the main
process stopped or died).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import pickle
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import dns.rcode

from region_agent.base.gc_pause import freeze_survivors
from region_agent.globaldns.acme.service import header_only
from region_agent.globaldns.answer import AnswerLater, Responder, ResponderLimits
from region_agent.globaldns.compiler import CompileReport, _compile_infrastructure
from region_agent.globaldns.geoip.proximity import GeoDatabase, ProximityMap, Site
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.server import BindError, DnsServer
from region_agent.globaldns.service import rate_limiter, tcp_limits
from region_agent.globaldns.settings import DnsSettings
from region_agent.globaldns.tables import IPAddress, Node, ZoneHolder, ZoneTables, negative_reply_factory
from region_agent.globaldns.workers import (
    FORWARD_TIMEOUT,
    FORWARDS_IN_FLIGHT,
    FRAME,
    STATS_INTERVAL,
    forward_budget,
    frame,
    read_frame,
)

logger = logging.getLogger("region_agent.dns.worker")


class WorkerLocator:
    """The worker's stand-in for the main process's ProximityMap: its own map over the same database."""

    def __init__(self) -> None:
        self.map: ProximityMap | None = None

    def choose(self, address: IPAddress, candidates: frozenset[str]) -> tuple[str | None, int]:
        if self.map is None:
            return None, 0  # not built yet: every healthy address, as without a database
        return self.map.choose(address, candidates)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, locators: dict[int, WorkerLocator]) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self.locators = locators

    def persistent_load(self, pid: Any) -> Any:
        return self.locators.get(pid[1])


Reply = AnswerLater


class TokenBucket:
    """``rate`` per second, at most ``burst`` saved; the clock is passed in."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.at = burst, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ForwardTable:
    """Forwards waiting for the main process's answer: a token each, at most ``limit``, dropped after ``timeout``.

    Pure (no sockets; the clock is passed in). At most ``limit`` (16) wait, so the earliest deadline
    is found by looking at all of them (``timeout`` may change while some wait). ``stats`` counts by
    outcome: ``forwarded``, ``answered``,
    ``timeout`` (dropped unanswered), ``busy`` (refused: ``limit`` in flight), ``late`` (an answer
    after its forward was dropped).
    """

    def __init__(self, limit: int, timeout: float) -> None:
        self.limit, self.timeout = limit, timeout
        self.pending: dict[int, tuple[float, Reply]] = {}
        self.token = 0
        self.stats: collections.Counter[str] = collections.Counter()

    def begin(self, reply: Reply, now: float) -> int | None:
        """A token for a new forward, or None when ``limit`` are in flight (counted ``busy``)."""
        if len(self.pending) >= self.limit:
            self.stats["busy"] += 1
            return None
        self.token += 1
        self.pending[self.token] = (now + self.timeout, reply)
        self.stats["forwarded"] += 1
        return self.token

    def complete(self, token: int, out: bytes | None) -> Reply | None:
        """The main process answered ``token``: its reply callback (call it with ``out``), None if dropped."""
        entry = self.pending.pop(token, None)
        if entry is None:
            self.stats["late"] += 1
            return None
        self.stats["answered"] += 1
        return entry[1]

    def drop(self, token: int) -> None:
        if self.pending.pop(token, None) is not None:
            self.stats["timeout"] += 1

    def expire(self, now: float) -> int:
        """Drop the forwards whose deadline has passed; how many."""
        expired = 0
        for token, (deadline, _reply) in list(self.pending.items()):  # at most ``limit``
            if deadline <= now:
                del self.pending[token]
                expired += 1
        self.stats["timeout"] += expired
        return expired

    def next_deadline(self) -> float | None:
        return min(deadline for deadline, _reply in self.pending.values()) if self.pending else None




class Forwarder:
    """UPDATEs and signed queries to the main process, within a budget, without holding the worker.

    The forward is written to the main process and the query gets no answer now: the listener's
    ``later`` (``answer.UpdateHandler``) says where its answer goes, which is sent when the main
    process's answer comes back with the forward's token (UDP: from the listening socket to the
    client's address; TCP: on its connection, out of order). At most ``FORWARDS_IN_FLIGHT`` wait
    (one more gets SERVFAIL at once); one not answered within ``FORWARD_TIMEOUT`` is dropped (the
    client retries). Counted in ``table.stats``.
    """

    def __init__(self, sock: socket.socket, per_second: float, burst: float) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.budget = TokenBucket(per_second, burst, time.monotonic())
        self.table = ForwardTable(FORWARDS_IN_FLIGHT, FORWARD_TIMEOUT)
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0  # the monotonic deadline the timer is for
        self.errors = 0   # reads, writes or reply callbacks that raised (logged)
        self.closed = False
        self.loop.add_reader(sock.fileno(), self._readable)

    def __call__(self, data: bytes, source: str | None, *, tcp: bool = False, our_payload: int = 1232,
                 later: Callable[[], AnswerLater] | None = None) -> bytes | None:
        now = time.monotonic()
        if self.closed or not self.budget.take(now):
            return header_only(data, dns.rcode.REFUSED)
        if later is None:  # a caller that takes no late answer: nothing here may wait for the main process
            return header_only(data, dns.rcode.SERVFAIL)
        data = bytes(data)  # it may be a view of the listener's buffer, reused by the next datagram
        token = self.table.begin(later(), now)
        if token is None:
            return header_only(data, dns.rcode.SERVFAIL)
        self._write(frame((token, data, source, tcp, our_payload)))
        self._arm()
        return None

    def _write(self, data: bytes) -> None:
        if self.closed:
            return
        if self.outbox:
            self.outbox += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as error:
            self._close(error)
            return
        if sent < len(data):
            self.outbox += data[sent:]
            self.loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._close(error)
            return
        del self.outbox[:sent]
        if not self.outbox:
            self.loop.remove_writer(self.sock.fileno())

    def _readable(self) -> None:
        """The main process's answers: each sent to whoever waits for its token."""
        try:
            while True:
                try:
                    chunk = self.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    break
                if not chunk:
                    self._close(None)
                    break
                self.inbox += chunk
            inbox = self.inbox
            while len(inbox) >= 4 and len(inbox) >= 4 + FRAME.unpack_from(inbox)[0]:
                (length,) = FRAME.unpack_from(inbox)
                token, out = pickle.loads(bytes(inbox[4:4 + length]))
                del inbox[:4 + length]
                reply = self.table.complete(token, out)
                if reply is not None and out is not None:  # None: the main process sends nothing
                    reply(out)
        except Exception as error:  # a bug costs the forwards in flight, never the worker: logged, counted
            self.errors += 1
            logger.exception("answers from the main process to forwarded UPDATEs could not be read")
            self._close(error)

    def _arm(self) -> None:
        """One timer, at the earliest deadline of the forwards in flight (moved earlier when need be)."""
        deadline = self.table.next_deadline()
        if deadline is None or (self.timer is not None and self.timer_at <= deadline):
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = deadline
        self.timer = self.loop.call_later(max(0.0, deadline - time.monotonic()) + 0.002, self._expire)

    def _expire(self) -> None:
        self.timer = None
        self._timed_out(self.table.expire(time.monotonic()))
        self._arm()

    def _timed_out(self, count: int) -> None:
        if count:
            timeouts = self.table.stats["timeout"]
            if timeouts == count or timeouts // 100 != (timeouts - count) // 100:
                logger.warning("UPDATE forwarded to the main process: no answer within %.1f s, dropped "
                               "(%d so far)", self.table.timeout, timeouts)

    def _close(self, error: BaseException | None) -> None:
        """The main process is gone (or the channel broke): no more forwards, the ones in flight dropped."""
        if self.closed:
            return
        self.closed = True
        logger.error("UPDATE forwarding to the main process ended (%r): UPDATEs get REFUSED", error)
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())
            self.loop.remove_writer(self.sock.fileno())
        self.table.stats["timeout"] += len(self.table.pending)
        self.table.pending.clear()


class Worker:
    def __init__(self, feed_fd: int, updates_fd: int) -> None:
        self.feed_fd, self.updates_fd = feed_fd, updates_fd
        self.holder = ZoneHolder()
        self.counters = DnsCounters()
        self.gen = 0
        self.latest: ZoneTables | None = None
        self.withheld = False
        self.pending: dict[bytes, Node] | None = None   # the generation being received (None: not applicable)
        self.pending_key = (0, 0)   # its (generation, base generation)
        self.resyncs = 0   # deltas on a generation this worker does not have: a snapshot asked for each
        self.locators: dict[int, WorkerLocator] = {}
        self.server: DnsServer | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.background: set[asyncio.Task[None]] = set()
        self.changed_nodes = 0
        self.forwarder: Forwarder | None = None

    async def run(self) -> int:
        reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=self.feed_fd))
        self.writer = writer
        # withheld comes with the hello: a worker must not answer its first tables if the zone is withheld.
        # no_tables: the main process has none yet (its first compile failed): bind now and answer SERVFAIL.
        _kind, self.index, settings, forward, self.withheld, no_tables = pickle.loads(await read_frame(reader))
        assert isinstance(settings, DnsSettings)
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s dns-worker-{self.index} %(levelname)s %(message)s")
        responder = Responder(self.holder, self.counters, ResponderLimits(
            our_payload=settings.udp_payload, memo_entries=settings.response_memo_entries), rate_limiter(settings.rrl))
        if forward:
            self.forwarder = Forwarder(socket.socket(fileno=self.updates_fd), *forward_budget(settings))
            responder.updates = self.forwarder
        self.server = DnsServer(responder, [(a, settings.port) for a in settings.listen_addresses],
                                tcp_limits(settings), share_port=True)
        stats = asyncio.get_running_loop().create_task(self._report())
        try:
            if no_tables and not await self._bind():
                return 2
            while True:
                try:
                    data = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return 0  # the main process is gone or stopping
                message = _Unpickler(data, self.locators).load()
                if not await self._apply(message):
                    return 2
                await asyncio.sleep(0)  # one chunk per loop turn: queries are answered between chunks
        finally:
            stats.cancel()
            await self.server.stop()

    async def _apply(self, message: tuple[Any, ...]) -> bool:
        kind = message[0]
        if kind == "nodes":
            _kind, gen, base_gen, nodes = message
            if gen <= self.gen:
                return True  # never older than what it answers
            if self.pending_key != (gen, base_gen):
                self.pending, self.pending_key = self._start(gen, base_gen), (gen, base_gen)
            if self.pending is not None:
                self.pending.update(nodes)
                self.changed_nodes += len(nodes)
        elif kind == "tables":
            await self._finish(message)
            if self.server is not None and not self.server.bound and self.latest is not None:
                return await self._bind()
        elif kind == "withhold":
            self.withheld = message[1]
            self._install()
        elif kind == "geo":
            _kind, token, path, sites = message
            locator = self.locators[token] = WorkerLocator()
            for old in [t for t in self.locators if t < token]:
                del self.locators[old]
            if path is not None:
                task = asyncio.get_running_loop().create_task(self._build_map(locator, path, sites))
                self.background.add(task)
                task.add_done_callback(self.background.discard)
        return True

    async def _bind(self) -> bool:
        """Bind the sockets and say so (``ready``); False (said: ``bind_error``) if they can not be bound."""
        assert self.server is not None and self.writer is not None
        try:
            await self.server.start()
        except BindError as error:
            self._send(("bind_error", str(error)))
            await self.writer.drain()
            return False
        self._send(("ready", self.server.bound))
        return True

    def _start(self, gen: int, base_gen: int) -> dict[bytes, Node] | None:
        """The nodes generation ``gen`` starts from; None if this worker does not have ``base_gen``.

        Then it asks the main process for a snapshot (once for this delta) and answers from the tables it
        has until the snapshot is in.
        """
        if base_gen == 0:
            return {}
        if base_gen == self.gen and self.latest is not None:
            return dict(self.latest.nodes)
        self.resyncs += 1
        logger.error("delta %d on generation %d, this worker has %d: ignored, a snapshot asked for (%d so far)",
                     gen, base_gen, self.gen, self.resyncs)
        self._send(("resync", gen, self.gen))
        return None

    async def _finish(self, message: tuple[Any, ...]) -> None:
        _kind, gen, base_gen, removed, apex, serial, ents, challenge_owners, config, regions = message
        if gen <= self.gen:
            return
        nodes = self.pending if self.pending_key == (gen, base_gen) else self._start(gen, base_gen)
        self.pending, self.pending_key = None, (0, 0)
        if nodes is None:
            return
        for owner in removed:
            nodes.pop(owner, None)
        infra = _compile_infrastructure(apex, regions, config, serial, CompileReport())
        self.latest = ZoneTables(apex, serial, nodes, ents, negative_reply_factory(infra.soa_at),
                                 challenge_owners=challenge_owners)
        self.gen = gen
        self._install()
        if self.changed_nodes >= 1000:
            freeze_survivors()  # the new nodes: later collections need not scan them (as the main process)
        self.changed_nodes = 0
        self._send(("ack", gen))

    def _install(self) -> None:
        if self.withheld:
            self.holder.clear()
        elif self.latest is not None:
            self.holder.replace(self.latest)
            self.counters.zone_serial = self.latest.serial

    async def _build_map(self, locator: WorkerLocator, path: str, sites: tuple[Site, ...]) -> None:
        try:
            database = await asyncio.to_thread(GeoDatabase.open, path)
            proximity = await asyncio.to_thread(ProximityMap, database, sites)
        except Exception:
            logger.exception("GeoIP database %s could not be opened: proximity names answer every healthy "
                             "address", path)
            return
        locator.map = proximity
        while not proximity.warm(2000):  # noqa: ASYNC110 - not waiting: slicing
            await asyncio.sleep(0.001)

    def _send(self, message: object) -> None:
        if self.writer is not None:
            self.writer.write(frame(message))

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            forwards = {} if self.forwarder is None else dict(self.forwarder.table.stats)
            self._send(("stats", self.counters, forwards))


def main(argv: list[str]) -> int:
    feed_fd, updates_fd = int(argv[1]), int(argv[2])
    worker = Worker(feed_fd, updates_fd)
    with contextlib.suppress(ImportError):
        import uvloop

        return uvloop.run(worker.run())
    return asyncio.run(worker.run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
