"""The real transport: encrypted UDP datagrams and encrypted one-message TCP streams on one port.

:class:`UdpTransport` carries the datagrams, :class:`StreamTransport` the TCP streams (and their
TLS); :class:`GossipTransport` binds the two on one port and is what the membership sends with.

Every datagram is sealed by the :class:`~region_agent.gossip.keyring.Keyring` and at most
``max_packet`` bytes (1,400: below the internet's path MTU); a bigger one is refused, never
fragmented. Push-pull messages go over TCP to the same port: one connection per message, framed
as ``length (4 bytes) | sealed(sender host str8 | sender port u16 | message)``. The sender's
advertised address travels inside the sealed part because a TCP peer's port is ephemeral, and the
reply must reach its gossip port. With a :class:`~region_agent.gossip.tls.GossipTls` the streams also run
under mutual TLS (cluster CA, TLS 1.3), the same frame still sealed by the keyring inside; a failed
handshake either way is counted and logged at most once a minute per peer address: ``tls_timeout``
when it did not finish in time (loss, a stalled peer: no certificate problem), ``tls`` otherwise (a
certificate of another CA or expired, here or at the peer, which then closes mid-handshake).

Datagrams and streams that fail to open are counted in ``stats.rejected`` by reason (``key``,
``version``, ``malformed``, ``too_large``, ``tls``, ``tls_timeout``) and dropped. The receiver's
methods are called from the event loop and never block (see :class:`~region_agent.gossip.membership.Membership`).

What others can cost the stream listener is bounded (:class:`StreamLimits`), since without TLS anyone
may connect and a frame can only be authenticated once it has been read whole (the AES-GCM tag is at
its end): ``max_connections`` in all, the longest idle closed for a newcomer when all are taken (as the
DNS TCP server does); ``max_per_source`` per IPv4 address or IPv6 /64, beyond which a newcomer is
refused; a frame's length is read first, and a frame over the stream bound, or one that does not fit
what is left of ``buffer_bytes`` (all connections) and ``source_buffer_bytes`` (its source), is refused
before any of it is read; a connection with no byte for ``idle_timeout``, or whose frame is not whole
``timeout`` after the handshake, is closed. Reads go in 64 KiB pieces, so nothing is buffered beyond
the frame's reservation. Counted in :class:`StreamCounters`.

What this agent's own streams may hold is bounded too (:class:`SendLimits`): at most ``per_peer`` (4) in
flight to one peer, well under any peer's ``max_per_source``, and ``queued_per_peer`` (4) more waiting for
a turn, the oldest waiting giving way to a newcomer; ``pending_bytes`` (64 MiB) of sealed messages waiting
or in flight in all, beyond which a new one is dropped at once. A send waits at most ``turn_timeout`` for
its turn, then has ``timeout`` of its own to connect, shake hands and write its frame, or is cut (aborted:
a peer that stopped reading holds nothing). Each drop is counted in ``StreamCounters.send_dropped``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import struct
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from region_agent.base.sockets import PortSharingError, set_port_sharing, source_key
from region_agent.gossip.keyring import OVERHEAD, Keyring, KeyringError
from region_agent.gossip.messages import Address, MessageError
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.tls import GossipTls, TlsServerStream

if TYPE_CHECKING:
    from region_agent.gossip.settings import GossipSettings

logger = logging.getLogger("region_agent.gossip")

MAX_PACKET = 1400
MAX_STREAM = 8 * 1024 * 1024
STREAM_TIMEOUT = 10.0
TLS_LOG_INTERVAL = 60.0  # seconds between two warnings about one peer's failed handshakes


def tls_failure(exc: BaseException) -> str:
    """The reason a handshake failed, as counted. A timeout is loss or a stalled peer; anything else (a
    certificate refused here, or a connection closed mid-handshake: the peer refusing ours) is ``tls``."""
    return "tls_timeout" if isinstance(exc, TimeoutError) else "tls"
FRAME_SLACK = 512  # a frame may pass max_stream by the sender header and the seal
READ_CHUNK = 64 * 1024  # one read of a frame: what a connection holds beyond its reservation
OUTGOING_PER_PEER = 4  # this agent's streams in flight to one peer; below every max_per_source
# And waiting for a turn: a healthy peer has a push-pull (or a reply) and a sync step outstanding at most;
# beyond that it reads too slowly, and a longer queue would only hold older state.
OUTGOING_QUEUED_PER_PEER = 4
MiB = 1024 * 1024
# Sealed bytes of this agent's own streams, waiting or in flight, all peers together: eight largest
# messages (MAX_STREAM), what one stalled peer can hold at most; as much as the listener buffers.
OUTGOING_PENDING_BYTES = 64 * MiB


@dataclass(frozen=True)
class StreamLimits:
    """What the stream listener lets others cost; the ``gossip.stream_*`` settings."""

    max_connections: int = 256
    max_per_source: int = 32
    timeout: float = STREAM_TIMEOUT
    idle_timeout: float = 3.0
    buffer_bytes: int = 64 * MiB
    source_buffer_bytes: int = 16 * MiB

    @classmethod
    def from_settings(cls, settings: GossipSettings) -> StreamLimits:
        return cls(max_connections=settings.stream_max_connections,
                   max_per_source=settings.stream_max_connections_per_source,
                   timeout=settings.stream_timeout, idle_timeout=settings.stream_idle_timeout,
                   buffer_bytes=settings.stream_buffer_bytes, source_buffer_bytes=settings.stream_source_buffer_bytes)


@dataclass(frozen=True)
class SendLimits:
    """What this agent's own streams may hold while they wait for a turn and go out (not settings: they
    follow from the protocol, a few messages to a peer at a time)."""

    per_peer: int = OUTGOING_PER_PEER
    queued_per_peer: int = OUTGOING_QUEUED_PER_PEER
    pending_bytes: int = OUTGOING_PENDING_BYTES
    turn_timeout: float = STREAM_TIMEOUT  # waiting for one of the peer's turns
    timeout: float = STREAM_TIMEOUT       # then connect, TLS handshake, write and close


@dataclass
class StreamCounters:
    """The listener's refusals and closes by reason, and what it holds now; this agent's own sends dropped
    by reason, and what they hold now (read at scrape time)."""

    refused: Counter[str] = field(default_factory=Counter)  # source_limit, buffer
    closed: Counter[str] = field(default_factory=Counter)   # evicted, idle, timeout
    accepted: int = 0
    open: int = 0
    buffered: int = 0       # bytes reserved for frames being read now
    peak_buffered: int = 0  # the most ever reserved at once (tests and benches read it)
    send_dropped: Counter[str] = field(default_factory=Counter)  # peer_queue, pending_bytes, turn_timeout, timeout
    send_pending: int = 0        # own sends waiting for a turn or in flight
    send_waiting: int = 0        # of which waiting for a turn
    send_pending_bytes: int = 0  # their sealed bytes
    peak_send_pending: int = 0        # the most ever at once (tests read them)
    peak_send_pending_bytes: int = 0


class _Waiting:
    """A sealed message waiting for one of its peer's turns, and the timer that drops it."""

    __slots__ = ("sealed", "timer")

    def __init__(self, sealed: bytes) -> None:
        self.sealed = sealed
        self.timer: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Outgoing:
    """One peer's sends: how many are in flight (a task each), and those waiting, oldest first (no task)."""

    __slots__ = ("in_flight", "waiting")

    def __init__(self) -> None:
        self.in_flight = 0
        self.waiting: deque[_Waiting] = deque()


class _IdleError(Exception):
    """No byte for ``idle_timeout``."""


class _Inbound:
    """One accepted connection: whose share it counts against, and what it has reserved."""

    __slots__ = ("reserved", "source", "task", "writer")

    def __init__(self, source: str, task: asyncio.Task[Any] | None, writer: asyncio.StreamWriter) -> None:
        self.source = source
        self.task = task
        self.writer = writer
        self.reserved = 0


class PacketTooLargeError(ValueError):
    """A datagram over the size bound: the caller must split it or use a stream."""


class PacketReceiver(Protocol):
    def receive_packet(self, data: bytes, source: Address) -> None: ...


class StreamReceiver(Protocol):
    def receive_stream(self, data: bytes, source: Address) -> None: ...


class Receiver(PacketReceiver, StreamReceiver, Protocol):
    pass


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, owner: UdpTransport) -> None:
        self._owner = owner

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self._owner._on_datagram(data, str(addr[0]), int(addr[1]))

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable and the like: the peer is gone, which probes will find out.
        logger.debug("gossip UDP error: %s", exc)


class UdpTransport:
    """Sealed datagrams of at most ``max_packet`` bytes on a bound UDP socket (:meth:`open`)."""

    def __init__(self, addr: Address, keyring: Keyring, stats: GossipStats, *, max_packet: int = MAX_PACKET) -> None:
        self.addr = addr
        self.keyring = keyring
        self.stats = stats
        self.max_packet = max_packet
        self.overhead = OVERHEAD
        self._receiver: PacketReceiver | None = None
        self._udp: asyncio.DatagramTransport | None = None

    async def open(self, sock: socket.socket) -> None:
        """Send and receive on ``sock``, already bound to :attr:`addr`'s port."""
        loop = asyncio.get_running_loop()
        self._udp, _ = await loop.create_datagram_endpoint(functools.partial(_Datagrams, self), sock=sock)
        try:
            # uvloop turned SO_REUSEADDR on as it took the socket; with it another uid could bind
            # beside us and read our datagrams. Off again, or no start.
            set_port_sharing(self._udp.get_extra_info("socket"), share=False)
        except PortSharingError:
            self._udp.close()
            self._udp = None
            raise

    def attach(self, receiver: PacketReceiver) -> None:
        self._receiver = receiver

    def close(self) -> None:
        if self._udp is not None:
            self._udp.close()

    def send_packet(self, addr: Address, data: bytes) -> None:
        sealed = self.keyring.encrypt(data)
        if len(sealed) > self.max_packet:
            raise PacketTooLargeError(f"{len(sealed)} byte datagram over {self.max_packet}")
        if self._udp is not None:
            self._udp.sendto(sealed, (addr.host, addr.port))

    def _on_datagram(self, data: bytes, host: str, port: int) -> None:
        if len(data) > self.max_packet:
            self.stats.rejected["too_large"] += 1
            return
        try:
            plain = self.keyring.decrypt(data)
            source = Address(host, port)
        except KeyringError as exc:
            self.stats.rejected[exc.reason] += 1
            return
        except MessageError:
            self.stats.rejected["malformed"] += 1
            return
        if self._receiver is not None:
            self._receiver.receive_packet(plain, source)


class StreamTransport:
    """One-message TCP streams, under mutual TLS with ``tls``: a listener (:meth:`listen`) and
    :meth:`send_stream`, each message naming ``addr`` as its sender."""

    def __init__(self, addr: Address, keyring: Keyring, stats: GossipStats, *, max_stream: int = MAX_STREAM,
                 tls: GossipTls | None = None, limits: StreamLimits | None = None,
                 send_limits: SendLimits | None = None) -> None:
        self.addr = addr
        self.keyring = keyring
        self.stats = stats
        self.max_stream = max_stream
        self.tls = tls
        self.limits = limits or StreamLimits()
        self.send_limits = send_limits or SendLimits()
        self.counters = StreamCounters()
        self._tls_logged: dict[str, float] = {}
        self._receiver: StreamReceiver | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Accepted connections, least recently active first: the one to close when all slots are taken.
        self._inbound: OrderedDict[_Inbound, None] = OrderedDict()
        self._per_source: Counter[str] = Counter()
        self._source_buffered: Counter[str] = Counter()
        self._outgoing: dict[Address, _Outgoing] = {}
        self._closed = False

    async def listen(self, host: str, port: int) -> None:
        """Accept streams on ``host:port``; raises ``OSError`` when the port is taken."""
        self._server = await asyncio.start_server(self._on_connection, host, port, reuse_address=True)

    def attach(self, receiver: StreamReceiver) -> None:
        self._receiver = receiver

    async def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for peer in self._outgoing.values():
            while peer.waiting:
                self._unqueue(peer.waiting.popleft())
        tasks = [*self._tasks, *(c.task for c in self._inbound if c.task is not None)]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def send_stream(self, addr: Address, data: bytes) -> None:
        """Send ``data`` to ``addr`` in the background, or drop it (counted) when :class:`SendLimits` say so."""
        host = self.addr.host.encode()
        sealed = self.keyring.encrypt(bytes([len(host)]) + host + struct.pack(">H", self.addr.port) + data)
        if len(sealed) > self.max_stream + FRAME_SLACK:
            raise PacketTooLargeError(f"{len(sealed)} byte stream message over {self.max_stream}")
        if self._closed:
            return
        limits, counters = self.send_limits, self.counters
        peer = self._outgoing.get(addr)
        oldest: _Waiting | None = None
        if peer is not None and peer.in_flight >= limits.per_peer and len(peer.waiting) >= limits.queued_per_peer:
            # The peer's queue is full: its oldest waiting message gives way. A newer push-pull carries this
            # agent's newer state (it supersedes the old one), a newer sync step belongs to a round the peer
            # still waits for; the oldest is also the nearest to its turn_timeout.
            if not peer.waiting:
                counters.send_dropped["peer_queue"] += 1
                return
            oldest = peer.waiting[0]
        held = counters.send_pending_bytes - (0 if oldest is None else len(oldest.sealed))
        if held and held + len(sealed) > limits.pending_bytes:  # (one message alone always goes)
            counters.send_dropped["pending_bytes"] += 1
            return
        if oldest is not None and peer is not None:
            peer.waiting.popleft()
            self._unqueue(oldest)
            counters.send_dropped["peer_queue"] += 1
        if peer is None:
            peer = self._outgoing[addr] = _Outgoing()
        counters.send_pending += 1
        counters.send_pending_bytes += len(sealed)
        counters.peak_send_pending = max(counters.peak_send_pending, counters.send_pending)
        counters.peak_send_pending_bytes = max(counters.peak_send_pending_bytes, counters.send_pending_bytes)
        if peer.in_flight < limits.per_peer:
            self._start(addr, peer, sealed)
            return
        waiting = _Waiting(sealed)
        waiting.timer = asyncio.get_running_loop().call_later(limits.turn_timeout, self._turn_expired,
                                                              addr, peer, waiting)
        peer.waiting.append(waiting)
        counters.send_waiting += 1

    def _start(self, addr: Address, peer: _Outgoing, sealed: bytes) -> None:
        peer.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._send_stream(addr, sealed), name=f"gossip-stream-{addr}")
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._sent, addr, peer, len(sealed)))

    def _sent(self, addr: Address, peer: _Outgoing, size: int, task: asyncio.Task[None]) -> None:
        """A send in flight ended (delivered, failed or cut): the peer's next waiting one takes its turn."""
        self._tasks.discard(task)
        peer.in_flight -= 1
        self.counters.send_pending -= 1
        self.counters.send_pending_bytes -= size
        while peer.waiting and peer.in_flight < self.send_limits.per_peer and not self._closed:
            waiting = peer.waiting.popleft()
            waiting.cancel()
            self.counters.send_waiting -= 1  # still pending, in flight now
            self._start(addr, peer, waiting.sealed)
        self._forget_peer(addr, peer)

    def _turn_expired(self, addr: Address, peer: _Outgoing, waiting: _Waiting) -> None:
        """No turn within turn_timeout: dropped, so a message is never sent long after it was meant to be."""
        peer.waiting.remove(waiting)
        self._unqueue(waiting)
        self.counters.send_dropped["turn_timeout"] += 1
        self._forget_peer(addr, peer)

    def _unqueue(self, waiting: _Waiting) -> None:
        """``waiting``, already out of its peer's queue, is dropped: it holds nothing any more."""
        waiting.cancel()
        self.counters.send_waiting -= 1
        self.counters.send_pending -= 1
        self.counters.send_pending_bytes -= len(waiting.sealed)

    def _forget_peer(self, addr: Address, peer: _Outgoing) -> None:
        if not peer.in_flight and not peer.waiting and self._outgoing.get(addr) is peer:
            del self._outgoing[addr]

    async def _send_stream(self, addr: Address, sealed: bytes) -> None:
        writer: asyncio.StreamWriter | None = None
        done = False
        try:
            # The whole of it within the budget, the close too: a peer that stops reading would otherwise
            # keep the connection (and the frame in its buffer) waiting for a flush forever.
            async with asyncio.timeout(self.send_limits.timeout):
                if self.tls is None:
                    _, writer = await asyncio.open_connection(addr.host, addr.port)
                else:
                    _, writer = await asyncio.open_connection(
                        addr.host, addr.port, ssl=self.tls.client_context, server_hostname="",
                        ssl_handshake_timeout=self.tls.handshake_timeout)
                    ssl_object = writer.get_extra_info("ssl_object")
                    if not self._peer_accepted(addr.host, None if ssl_object is None else
                                               ssl_object.getpeercert(binary_form=True)):
                        return
                writer.write(struct.pack(">I", len(sealed)) + sealed)
                await writer.drain()
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                done = True
        except ssl.SSLError as exc:  # the peer's certificate failed here, or ours there
            self._tls_failed(addr.host, exc)
        except TimeoutError as exc:
            # Not connected, or not written, within the budget: black-holed or stalled (the probes decide
            # what that means for the member); the message is dropped.
            self.counters.send_dropped["timeout"] += 1
            logger.debug("gossip stream to %s timed out: %s", addr, exc)
        except OSError as exc:
            # The peer is unreachable: the probes decide what that means, not the stream.
            logger.debug("gossip stream to %s failed: %s", addr, exc)
        finally:
            if writer is not None and not done:
                writer.transport.abort()  # nothing to flush: what was not written is dropped

    def _peer_accepted(self, host: str, der: bytes | None) -> bool:
        """The TLS peer's certificate passed the handshake (it chains to the CA); is it also an identity
        this agent trusts (not revoked)? Learned for checking what it signs."""
        check = None if self.tls is None else self.tls.peer_check
        if check is None:
            return True
        reason = "no-certificate" if der is None else check(der)
        if reason is None:
            return True
        self.stats.rejected[reason] += 1
        logger.debug("gossip stream with %s refused: %s", host, reason)
        return False

    def _tls_failed(self, host: str, exc: BaseException) -> None:
        self.stats.rejected[tls_failure(exc)] += 1
        now = time.monotonic()
        if now - self._tls_logged.get(host, -TLS_LOG_INTERVAL) >= TLS_LOG_INTERVAL:
            if len(self._tls_logged) > 1024:  # forget peers quiet for a minute: the map stays small
                self._tls_logged = {h: t for h, t in self._tls_logged.items() if now - t < TLS_LOG_INTERVAL}
            self._tls_logged[host] = now
            logger.warning("gossip TLS handshake with %s failed (further failures of this peer counted, "
                           "logged again after %.0f s): %s", host, TLS_LOG_INTERVAL, exc)

    # --- connection slots and frame reservations ---------------------------------------------

    def _admit(self, conn: _Inbound) -> bool:
        """Take a slot, closing the longest-idle connection if all are taken; refuse past the source's share."""
        if self._per_source[conn.source] >= self.limits.max_per_source:
            self.counters.refused["source_limit"] += 1
            return False
        while len(self._inbound) >= self.limits.max_connections:
            self._evict(next(iter(self._inbound)))
        self._inbound[conn] = None
        self._per_source[conn.source] += 1
        self.counters.accepted += 1
        self.counters.open = len(self._inbound)
        return True

    def _evict(self, conn: _Inbound) -> None:
        self.counters.closed["evicted"] += 1
        self._forget(conn)
        conn.writer.transport.abort()  # what it sent is worth nothing now: no graceful close
        if conn.task is not None:
            conn.task.cancel()

    def _forget(self, conn: _Inbound) -> None:
        """Give back its slot and reservation (once; later calls do nothing)."""
        if conn not in self._inbound:
            return
        del self._inbound[conn]
        self._per_source[conn.source] -= 1
        if self._per_source[conn.source] <= 0:
            del self._per_source[conn.source]
        self._release(conn)
        self.counters.open = len(self._inbound)

    def _reserve(self, conn: _Inbound, size: int) -> bool:
        """Room for a ``size`` byte frame in the listener's and the source's buffer budget, taken."""
        if (self.counters.buffered + size > self.limits.buffer_bytes
                or self._source_buffered[conn.source] + size > self.limits.source_buffer_bytes):
            self.counters.refused["buffer"] += 1
            return False
        conn.reserved = size
        self._source_buffered[conn.source] += size
        self.counters.buffered += size
        self.counters.peak_buffered = max(self.counters.peak_buffered, self.counters.buffered)
        return True

    def _release(self, conn: _Inbound) -> None:
        if not conn.reserved:
            return
        self.counters.buffered -= conn.reserved
        self._source_buffered[conn.source] -= conn.reserved
        if self._source_buffered[conn.source] <= 0:
            del self._source_buffered[conn.source]
        conn.reserved = 0

    # --- receiving ------------------------------------------------------------------------------

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else "?"
        conn = _Inbound(source_key(host), asyncio.current_task(), writer)
        if not self._admit(conn):
            writer.transport.abort()
            return
        # Cancelled at shutdown or evicted, a connection callback would make asyncio log a traceback.
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await self._on_stream(conn, host, reader, writer)
        finally:
            self._forget(conn)
            writer.close()

    async def _on_stream(self, conn: _Inbound, host: str, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        readexactly: Callable[[int], Awaitable[bytes]] = reader.readexactly
        if self.tls is not None:
            stream = TlsServerStream(reader, writer, self.tls.server_context)
            try:
                async with asyncio.timeout(self.tls.handshake_timeout):
                    await stream.handshake()
            except (OSError, TimeoutError, EOFError) as exc:  # SSLError, a reset, the handshake timeout
                self._tls_failed(host, exc if str(exc) else TimeoutError(
                    f"no handshake in {self.tls.handshake_timeout} s"))
                return
            if not self._peer_accepted(host, stream.peer_certificate()):
                return
            readexactly = stream.readexactly
        sealed = await self._read_frame(conn, readexactly)
        writer.close()
        if sealed is not None:
            self._open_frame(sealed)

    async def _read_frame(self, conn: _Inbound, readexactly: Callable[[int], Awaitable[bytes]]) -> bytes | None:
        """The sealed frame, or None (refused, cut or timed out: counted)."""
        try:
            async with asyncio.timeout(self.limits.timeout):
                (size,) = struct.unpack(">I", await self._read(conn, readexactly, 4))
                if size > self.max_stream + FRAME_SLACK:
                    self.stats.rejected["too_large"] += 1
                    return None
                if not self._reserve(conn, size):
                    return None
                return await self._read(conn, readexactly, size)
        except _IdleError:
            self.counters.closed["idle"] += 1
        except TimeoutError:
            self.counters.closed["timeout"] += 1
        except (OSError, asyncio.IncompleteReadError):
            self.stats.rejected["malformed"] += 1
        return None

    async def _read(self, conn: _Inbound, readexactly: Callable[[int], Awaitable[bytes]], size: int) -> bytes:
        """``size`` bytes in READ_CHUNK pieces, each within ``idle_timeout``; every piece makes it active."""
        pieces: list[bytes] = []
        left = size
        while left:
            try:
                async with asyncio.timeout(self.limits.idle_timeout):
                    piece = await readexactly(min(left, READ_CHUNK))
            except TimeoutError:
                raise _IdleError from None
            pieces.append(piece)
            left -= len(piece)
            if conn in self._inbound:
                self._inbound.move_to_end(conn)
        return b"".join(pieces)

    def _open_frame(self, sealed: bytes) -> None:
        try:
            plain = self.keyring.decrypt(sealed)
            length = plain[0]
            if len(plain) < 3 + length:
                raise MessageError("short stream header")
            host = plain[1:1 + length].decode()
            (port,) = struct.unpack(">H", plain[1 + length:3 + length])
            source = Address(host, port)
        except KeyringError as exc:
            self.stats.rejected[exc.reason] += 1
            return
        except (MessageError, UnicodeDecodeError, IndexError):
            self.stats.rejected["malformed"] += 1
            return
        if self._receiver is not None:
            self._receiver.receive_stream(plain[3 + length:], source)


class GossipTransport:
    """Datagrams and streams on one port; bind with :meth:`start`, hand it to a Membership, then
    :meth:`attach` the membership."""

    def __init__(self, packets: UdpTransport, streams: StreamTransport) -> None:
        self.packets = packets
        self.streams = streams
        self.addr = streams.addr  # the advertised address: what peers reach and streams name us by
        self.keyring = packets.keyring
        self.stats = packets.stats
        self.overhead = packets.overhead

    @classmethod
    async def start(cls, host: str, port: int, keyring: Keyring, stats: GossipStats, *, advertised: str | None = None,
                    tls: GossipTls | None = None, max_packet: int = MAX_PACKET, max_stream: int = MAX_STREAM,
                    limits: StreamLimits | None = None, send_limits: SendLimits | None = None) -> GossipTransport:
        """Listen for UDP and TCP on ``host:port``; port 0 picks one that is free for both.

        ``advertised`` (default ``host``) is the host peers reach this agent at, which each stream
        names as its sender. With ``tls`` the TCP streams, both ways, run under mutual TLS (see
        :mod:`region_agent.gossip.tls`).
        """
        for _ in range(20):
            udp_sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
            udp_sock.bind((host, port))
            chosen = udp_sock.getsockname()[1]
            streams = StreamTransport(Address(advertised or host, chosen), keyring, stats, max_stream=max_stream,
                                      tls=tls, limits=limits, send_limits=send_limits)
            try:
                await streams.listen(host, chosen)
            except OSError:
                udp_sock.close()
                if port:
                    raise
                continue  # the TCP side of that port is taken: try another
            packets = UdpTransport(Address(host, chosen), keyring, stats, max_packet=max_packet)
            try:
                await packets.open(udp_sock)
            except OSError:
                await streams.close()
                raise
            return cls(packets, streams)
        raise OSError(f"no port free for both UDP and TCP on {host}")

    def attach(self, receiver: Receiver) -> None:
        self.packets.attach(receiver)
        self.streams.attach(receiver)

    def send_packet(self, addr: Address, data: bytes) -> None:
        self.packets.send_packet(addr, data)

    def send_stream(self, addr: Address, data: bytes) -> None:
        self.streams.send_stream(addr, data)

    async def close(self) -> None:
        self.packets.close()
        await self.streams.close()
