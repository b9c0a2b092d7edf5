"""A DNS worker process (``dns.workers`` > 1): answers from tables fed by the main process.

Started by :mod:`region_agent.globaldns.workers` as ``python -m region_agent.globaldns.worker_main
FEED_FD UPDATES_FD``. It reads a hello (its index, the DNS settings), then generations of tables as
deltas; it binds its sockets (``SO_REUSEPORT``) only once the first snapshot is in, so it never
answers from no zone. It acknowledges each generation, reports its counters every
``STATS_INTERVAL``, forwards UPDATEs to the main process, and exits when the feed ends (the main
process stopped or died).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import sys
import time
from typing import Any

import dns.rcode

from region_agent.base.gc_pause import freeze_survivors
from region_agent.globaldns.acme.service import header_only
from region_agent.globaldns.answer import Responder, ResponderLimits
from region_agent.globaldns.compiler import CompileReport, _compile_infrastructure
from region_agent.globaldns.geoip.proximity import GeoDatabase, ProximityMap, Site
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.server import BindError, DnsServer
from region_agent.globaldns.service import rate_limiter, tcp_limits
from region_agent.globaldns.settings import DnsSettings
from region_agent.globaldns.tables import IPAddress, Node, ZoneHolder, ZoneTables, negative_reply_factory
from region_agent.globaldns.workers import FORWARD_TIMEOUT, FRAME, STATS_INTERVAL, frame, read_frame

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


class Forwarder:
    """UPDATEs and signed queries to the main process, synchronously, within a budget."""

    def __init__(self, fd: int, per_second: float) -> None:
        self.sock = socket.socket(fileno=fd)
        self.rate, self.burst = per_second * 2, per_second * 4  # twice the main process's budgets
        self.tokens, self.at = self.burst, time.monotonic()
        self.buffer = bytearray()
        self.request = 0

    def __call__(self, data: bytes, source: str | None, *, tcp: bool = False, our_payload: int = 1232) -> bytes | None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return header_only(data, dns.rcode.REFUSED)
        self.tokens -= 1
        self.request += 1
        self.sock.settimeout(FORWARD_TIMEOUT)
        try:
            self.sock.sendall(frame((self.request, data, source, tcp, our_payload)))
            deadline = now + FORWARD_TIMEOUT
            while True:
                while len(self.buffer) >= 4 and len(self.buffer) >= 4 + FRAME.unpack_from(self.buffer)[0]:
                    (length,) = FRAME.unpack_from(self.buffer)
                    request, out = pickle.loads(bytes(self.buffer[4:4 + length]))
                    del self.buffer[:4 + length]
                    if request == self.request:
                        return out  # type: ignore[no-any-return]
                self.sock.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = self.sock.recv(65536)
                if not chunk:
                    return None
                self.buffer += chunk
        except (TimeoutError, OSError):
            logger.warning("UPDATE forwarded to the main process: no answer within %.1f s", FORWARD_TIMEOUT)
            return None


class Worker:
    def __init__(self, feed_fd: int, updates_fd: int) -> None:
        self.feed_fd, self.updates_fd = feed_fd, updates_fd
        self.holder = ZoneHolder()
        self.counters = DnsCounters()
        self.gen = 0
        self.latest: ZoneTables | None = None
        self.withheld = False
        self.pending: dict[bytes, Node] | None = None
        self.pending_gen = 0
        self.locators: dict[int, WorkerLocator] = {}
        self.server: DnsServer | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.background: set[asyncio.Task[None]] = set()
        self.changed_nodes = 0

    async def run(self) -> int:
        reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=self.feed_fd))
        self.writer = writer
        # withheld comes with the hello: a worker must not answer its first tables if the zone is withheld
        _kind, self.index, settings, forward, self.withheld = pickle.loads(await read_frame(reader))
        assert isinstance(settings, DnsSettings)
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s dns-worker-{self.index} %(levelname)s %(message)s")
        responder = Responder(self.holder, self.counters, ResponderLimits(
            our_payload=settings.udp_payload, memo_entries=settings.response_memo_entries), rate_limiter(settings.rrl))
        if forward:
            responder.updates = Forwarder(self.updates_fd, settings.acme.updates_per_second)
        self.server = DnsServer(responder, [(a, settings.port) for a in settings.listen_addresses],
                                tcp_limits(settings), share_port=True)
        stats = asyncio.get_running_loop().create_task(self._report())
        try:
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
            if self.pending is None or self.pending_gen != gen:
                self.pending = self._start(base_gen)
                self.pending_gen = gen
            if self.pending is not None:
                self.pending.update(nodes)
                self.changed_nodes += len(nodes)
        elif kind == "tables":
            await self._finish(message)
            if self.server is not None and not self.server.bound and self.latest is not None:
                try:
                    await self.server.start()
                except BindError as error:
                    self._send(("bind_error", str(error)))
                    assert self.writer is not None
                    await self.writer.drain()
                    return False
                self._send(("ready", self.server.bound))
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

    def _start(self, base_gen: int) -> dict[bytes, Node] | None:
        if base_gen == 0:
            return {}
        if base_gen == self.gen and self.latest is not None:
            return dict(self.latest.nodes)
        logger.error("delta on generation %d, this worker has %d: ignored until a snapshot", base_gen, self.gen)
        return None

    async def _finish(self, message: tuple[Any, ...]) -> None:
        _kind, gen, base_gen, removed, apex, serial, ents, challenge_owners, config, regions = message
        if gen <= self.gen:
            return
        nodes = self.pending if self.pending_gen == gen else self._start(base_gen)
        self.pending, self.pending_gen = None, 0
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
            self._send(("stats", self.counters))


def main(argv: list[str]) -> int:
    feed_fd, updates_fd = int(argv[1]), int(argv[2])
    worker = Worker(feed_fd, updates_fd)
    with contextlib.suppress(ImportError):
        import uvloop

        return uvloop.run(worker.run())
    return asyncio.run(worker.run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
