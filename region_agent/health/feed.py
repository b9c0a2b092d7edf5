"""The agent → health sidecar feed over a Unix socket, and the staleness rule.

The agent runs a :class:`FeedPublisher` (the socket's server); each health sidecar runs a
:class:`FeedSubscriber`, which is the sidecar listener's :class:`~region_agent.health.source.ViewSource`.
Wire format: :mod:`region_agent.health.feed_protocol` (a snapshot per connection, then deltas, and
heartbeats).

Why the agent serves and the sidecar connects: the agent is the one that restarts with
new code and state; the sidecar just keeps redialling with a short jittered backoff (cap
``feed_reconnect_max_seconds``) and so hears a restarted agent within about a second.
The publisher never waits for a subscriber: it writes and moves on, and drops a
subscriber whose unsent backlog exceeds the cap (the sidecar reconnects and gets a fresh
snapshot), so a stuck sidecar can not slow the agent.

**Staleness rule** (in the subscriber). The sidecar holds one view and the time the agent
last *vouched* for it. A message or heartbeat on a connection vouches for the held view
when the held view is that connection's current view. A freshly restarted agent first
publishes a view that is not yet synced (its first full LIST is still running): that
view does not replace a synced one, and its heartbeats do not vouch for the old one. So
an agent restart within the bound changes nothing visible (the old view keeps answering
until the new agent syncs, then the new one takes over), and an agent that stays
unsynced or silent longer than ``stale_after_seconds`` makes every project answer 503
``stale``. Time is the sidecar's own monotonic clock: no cross-process clock comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from region_agent.base.clock import Backoff, Clock, SystemClock
from region_agent.base.names import region_name
from region_agent.base.tasks import cancel_and_wait, create_guarded_task
from region_agent.health.feed_protocol import (
    Delta,
    FeedProtocolError,
    Snapshot,
    apply_delta,
    decode,
    encode_delta,
    encode_heartbeat,
    encode_snapshot,
)
from region_agent.health.settings import HealthSettings
from region_agent.health.views import Freshness
from region_agent.state.local import RegionView

__all__ = ["FeedPublisher", "FeedSubscriber"]

logger = logging.getLogger("region_agent.health.feed")
_ENCODE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class FeedPublisher:
    """Agent side: serves the feed socket; :meth:`publish` is non-blocking, latest view wins.

    Changes are coalesced: at most one delta per ``min_interval``. ``publish`` may be
    called from the agent's event loop at any rate; encoding happens in the publisher's
    own task.
    """

    def __init__(
        self,
        *,
        socket_path: Path,
        registry: CollectorRegistry,
        heartbeat_interval: float = 1.0,
        min_interval: float = 0.2,
        max_buffer_bytes: int = 64 * 1024 * 1024,
        log: logging.Logger = logger,
    ) -> None:
        self._path = socket_path
        self._heartbeat_interval = heartbeat_interval
        self._min_interval = min_interval
        self._max_buffer = max_buffer_bytes
        self._log = log
        self._latest: RegionView | None = None
        self._sent: RegionView | None = None  # what every connected subscriber holds
        self._snapshot: tuple[RegionView, bytes] | None = None
        self._seq = 0
        self._changed: asyncio.Event | None = None
        self._subscribers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._m_subscribers = Gauge(
            "region_agent_health_publisher_subscribers", "Health sidecars connected to the feed.",
            registry=registry,
        )
        self._m_messages = Counter(
            "region_agent_health_publisher_messages", "Feed messages written, by type (per subscriber).",
            ["type"], registry=registry,
        )
        self._m_dropped = Counter(
            "region_agent_health_publisher_dropped_subscribers",
            "Subscribers disconnected because their unsent backlog exceeded the cap.", registry=registry,
        )
        self._m_encode = Histogram(
            "region_agent_health_publisher_encode_seconds", "Time to encode one snapshot or delta.",
            buckets=_ENCODE_BUCKETS, registry=registry,
        )
        self._m_encode_errors = Counter(
            "region_agent_health_publisher_encode_errors", "Views that could not be encoded (not sent).",
            registry=registry,
        )
        self._m_last = Gauge(
            "region_agent_health_publisher_last_send_timestamp_seconds",
            "Wall time of the last message (change or heartbeat) written to the feed.", registry=registry,
        )

    @classmethod
    def from_settings(cls, settings: HealthSettings, *, registry: CollectorRegistry) -> FeedPublisher:
        return cls(
            socket_path=settings.feed_socket, registry=registry,
            heartbeat_interval=settings.heartbeat_interval_seconds,
            min_interval=settings.feed_min_interval_seconds, max_buffer_bytes=settings.feed_max_line_bytes,
        )

    def publish(self, view: RegionView) -> None:
        """Offer a new view (never blocks, never raises); sent within ``min_interval``."""
        self._latest = view
        if self._changed is not None:
            self._changed.set()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("FeedPublisher.start() called twice; call stop() first")
        self._path.parent.mkdir(parents=True, exist_ok=True)
        # A socket file left by a previous agent is replaced (asyncio removes stale sockets).
        self._server = await asyncio.start_unix_server(self._serve_subscriber, path=str(self._path))
        os.chmod(self._path, 0o660)
        self._changed = asyncio.Event()
        if self._latest is not None:
            self._changed.set()
        self._tasks = [
            create_guarded_task(self._broadcasts(), name="health-feed-broadcasts", log=self._log),
            create_guarded_task(self._heartbeats(), name="health-feed-heartbeats", log=self._log),
        ]
        await asyncio.sleep(0)  # let both tasks begin, so a stop() right away cancels running code
        self._log.info("health feed serving on %s", self._path)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks, budget=2.0)
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._subscribers):
            writer.close()
        self._subscribers.clear()
        self._m_subscribers.set(0)
        if server is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
        self._changed = None

    # --- subscribers ----------------------------------------------------------------------

    async def _serve_subscriber(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._subscribers.add(writer)
        self._m_subscribers.set(len(self._subscribers))
        self._log.info("health sidecar connected to the feed (%d connected)", len(self._subscribers))
        try:
            if self._sent is not None:
                self._write(writer, self._snapshot_line(), "snapshot")
            # The sidecar never speaks; reading only tells us when it goes away.
            while await reader.read(4096):
                pass
        except (ConnectionError, OSError):
            pass
        finally:
            self._subscribers.discard(writer)
            self._m_subscribers.set(len(self._subscribers))
            writer.close()
            self._log.info("health sidecar left the feed (%d connected)", len(self._subscribers))

    def _snapshot_line(self) -> bytes:
        sent = self._sent
        assert sent is not None
        if self._snapshot is None or self._snapshot[0] is not sent:
            started = time.perf_counter()
            self._snapshot = (sent, encode_snapshot(sent, self._seq))
            self._m_encode.observe(time.perf_counter() - started)
        return self._snapshot[1]

    def _write(self, writer: asyncio.StreamWriter, line: bytes, kind: str) -> None:
        if writer.is_closing():
            self._subscribers.discard(writer)
            return
        if writer.transport.get_write_buffer_size() + len(line) > self._max_buffer:
            self._log.warning("health sidecar is not reading the feed; dropping it so it resyncs")
            self._m_dropped.inc()
            self._subscribers.discard(writer)
            writer.transport.abort()
            return
        writer.write(line)
        self._m_messages.labels(kind).inc()
        self._m_last.set(time.time())

    def _write_all(self, line: bytes, kind: str) -> None:
        for writer in list(self._subscribers):
            self._write(writer, line, kind)
        self._m_subscribers.set(len(self._subscribers))

    async def _broadcasts(self) -> None:
        changed = self._changed
        assert changed is not None
        while True:
            await changed.wait()
            changed.clear()
            view = self._latest
            if view is not None and view is not self._sent:
                try:
                    self._send_change(view)
                except (TypeError, ValueError):
                    # A view that can not be encoded (a bug in its producer): keep serving the
                    # last good one; the sidecars' answers go stale if this persists.
                    self._log.exception("health feed: can not encode the view; not sent")
                    self._m_encode_errors.inc()
            if self._min_interval > 0:
                await asyncio.sleep(self._min_interval)  # coalescing window: latest wins

    def _send_change(self, view: RegionView) -> None:
        self._seq += 1
        if self._subscribers:
            started = time.perf_counter()
            if self._sent is None:
                line, kind = encode_snapshot(view, self._seq), "snapshot"
            else:
                line, kind = encode_delta(self._sent, view, self._seq), "delta"
            self._m_encode.observe(time.perf_counter() - started)
            self._write_all(line, kind)
        self._sent = view

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            self._seq += 1
            self._write_all(encode_heartbeat(self._seq), "heartbeat")


class FeedSubscriber:
    """Sidecar side: keeps the agent's view and decides freshness; a :class:`ViewSource`."""

    def __init__(
        self,
        *,
        socket_path: Path,
        region: str,
        stale_after: float,
        registry: CollectorRegistry,
        max_line_bytes: int = 64 * 1024 * 1024,
        reconnect_max: float = 1.0,
        clock: Clock | None = None,
        log: logging.Logger = logger,
    ) -> None:
        self._path = socket_path
        self._region = region_name(region)
        self._bound = stale_after
        self._max_line = max_line_bytes
        self._clock = clock or SystemClock()
        self._monotonic = self._clock.monotonic
        self._backoff = Backoff(
            initial=min(0.05, reconnect_max), cap=reconnect_max, reset_after=10 * reconnect_max
        )
        self._log = log
        self._held: RegionView | None = None
        self._vouched_at: float | None = None
        self._never = Freshness(sidecar=True, stale=True, age_seconds=None, bound_seconds=stale_after)
        self._m_connected = Gauge(
            "region_agent_health_feed_connected", "1 while the sidecar is connected to the agent's feed.",
            registry=registry,
        )
        self._m_connects = Counter(
            "region_agent_health_feed_connects", "Successful connections to the agent's feed.",
            registry=registry,
        )
        self._m_messages = Counter(
            "region_agent_health_feed_messages", "Valid feed messages received, by type.", ["type"],
            registry=registry,
        )
        self._m_errors = Counter(
            "region_agent_health_feed_errors",
            "Feed failures by kind: connect (agent not there), invalid (a line failed validation), "
            "oversize (a line over feed_max_line_bytes), closed (the agent hung up).",
            ["kind"], registry=registry,
        )
        self._m_last = Gauge(
            "region_agent_health_feed_last_message_timestamp_seconds",
            "Wall time of the last valid feed message.", registry=registry,
        )
        self._m_decode = Histogram(
            "region_agent_health_feed_decode_seconds", "Time to validate and apply one feed message.",
            buckets=_ENCODE_BUCKETS, registry=registry,
        )

    @classmethod
    def from_settings(
        cls, settings: HealthSettings, *, region: str, registry: CollectorRegistry, clock: Clock | None = None
    ) -> FeedSubscriber:
        return cls(
            socket_path=settings.feed_socket, region=region, stale_after=settings.stale_after_seconds,
            registry=registry, max_line_bytes=settings.feed_max_line_bytes,
            reconnect_max=settings.feed_reconnect_max_seconds, clock=clock,
        )

    # --- ViewSource ----------------------------------------------------------------------

    def current(self) -> tuple[RegionView | None, Freshness]:
        vouched = self._vouched_at
        if vouched is None:
            return self._held, self._never
        age = self._monotonic() - vouched
        return self._held, Freshness(sidecar=True, stale=age > self._bound, age_seconds=age,
                                     bound_seconds=self._bound)

    # --- the connection loop ---------------------------------------------------------------

    async def run(self) -> None:
        """Connect, follow, reconnect with jittered backoff; forever (cancel to stop)."""
        failures = 0
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self._path), limit=self._max_line)
            except OSError as exc:
                failures += 1
                self._m_errors.labels("connect").inc()
                level = logging.WARNING if failures == 1 else logging.DEBUG
                self._log.log(level, "health feed: can not reach the agent at %s: %s", self._path, exc)
            else:
                if failures:
                    self._log.info("health feed: connected after %d failed attempts", failures)
                failures = 0
                self._m_connects.inc()
                self._m_connected.set(1)
                try:
                    await self._follow(reader)
                finally:
                    self._m_connected.set(0)
                    writer.close()
            await asyncio.sleep(self._backoff.next_delay(self._monotonic()))

    async def _follow(self, reader: asyncio.StreamReader) -> None:
        """Apply one connection's messages until it ends or can no longer be trusted."""
        conn_view: RegionView | None = None
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # over the limit: the stream can not be resynchronized
                self._m_errors.labels("oversize").inc()
                self._log.warning("health feed: a line exceeds %d bytes; reconnecting", self._max_line)
                return
            except (ConnectionError, OSError) as exc:
                self._m_errors.labels("closed").inc()
                self._log.warning("health feed: connection lost: %s", exc)
                return
            if not line.endswith(b"\n"):
                self._m_errors.labels("closed").inc()
                self._log.warning("health feed: the agent closed the feed")
                return
            started = time.perf_counter()
            try:
                conn_view = self._apply(conn_view, line)
            except FeedProtocolError as exc:
                # Never applied; and since a lost delta would leave our copy silently different
                # from the agent's, resynchronize: a new connection starts with a snapshot.
                self._m_errors.labels("invalid").inc()
                self._log.warning("health feed: ignoring an invalid line (%d bytes) and resyncing: %s",
                                  len(line), exc)
                return
            self._m_decode.observe(time.perf_counter() - started)
            self._m_last.set(time.time())
            self._backoff.reset()
            self._adopt(conn_view)

    def _apply(self, conn_view: RegionView | None, line: bytes) -> RegionView | None:
        message = decode(line)
        self._m_messages.labels(message.type).inc()
        if isinstance(message, Snapshot):
            view = message.view
        elif isinstance(message, Delta):
            if conn_view is None:
                raise FeedProtocolError("a delta before any snapshot on this connection")
            view = apply_delta(conn_view, message)
        else:
            return conn_view
        if view.region != self._region:
            raise FeedProtocolError(
                f"the feed is region {view.region!r}'s; this sidecar serves {self._region!r}"
            )
        return view

    def _adopt(self, conn_view: RegionView | None) -> None:
        """The staleness rule (module docstring): replace the held view, and vouch for it."""
        if conn_view is None:
            return
        held = self._held
        if held is not conn_view:
            if conn_view.synced or held is None or not held.synced:
                self._held = held = conn_view
            else:
                return  # a restarted agent not yet synced: keep the old view, do not vouch
        self._vouched_at = self._monotonic()
