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
handshake either way is counted as ``tls`` and logged at most once a minute per peer address.

Datagrams and streams that fail to open are counted in ``stats.rejected`` by reason (``key``,
``version``, ``malformed``, ``too_large``, ``tls``) and dropped. The receiver's methods are called from the
event loop and never block (see :class:`~region_agent.gossip.membership.Membership`).
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
from typing import Any, Protocol

from region_agent.base.sockets import PortSharingError, set_port_sharing
from region_agent.gossip.keyring import OVERHEAD, Keyring, KeyringError
from region_agent.gossip.messages import Address, MessageError
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.tls import GossipTls, TlsServerStream

logger = logging.getLogger("region_agent.gossip")

MAX_PACKET = 1400
MAX_STREAM = 8 * 1024 * 1024
STREAM_TIMEOUT = 10.0
TLS_LOG_INTERVAL = 60.0  # seconds between two warnings about one peer's failed handshakes


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
                 tls: GossipTls | None = None) -> None:
        self.addr = addr
        self.keyring = keyring
        self.stats = stats
        self.max_stream = max_stream
        self.tls = tls
        self._tls_logged: dict[str, float] = {}
        self._receiver: StreamReceiver | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def listen(self, host: str, port: int) -> None:
        """Accept streams on ``host:port``; raises ``OSError`` when the port is taken."""
        self._server = await asyncio.start_server(self._on_connection, host, port, reuse_address=True)

    def attach(self, receiver: StreamReceiver) -> None:
        self._receiver = receiver

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def send_stream(self, addr: Address, data: bytes) -> None:
        host = self.addr.host.encode()
        sealed = self.keyring.encrypt(bytes([len(host)]) + host + struct.pack(">H", self.addr.port) + data)
        if len(sealed) > self.max_stream + 512:
            raise PacketTooLargeError(f"{len(sealed)} byte stream message over {self.max_stream}")
        task = asyncio.get_running_loop().create_task(self._send_stream(addr, sealed), name=f"gossip-stream-{addr}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_stream(self, addr: Address, sealed: bytes) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(STREAM_TIMEOUT):
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
        except ssl.SSLError as exc:  # the peer's certificate failed here, or ours there
            self._tls_failed(addr.host, exc)
        except (OSError, TimeoutError) as exc:
            # The peer is unreachable: the probes decide what that means, not the stream.
            logger.debug("gossip stream to %s failed: %s", addr, exc)
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

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
        self.stats.rejected["tls"] += 1
        now = time.monotonic()
        if now - self._tls_logged.get(host, -TLS_LOG_INTERVAL) >= TLS_LOG_INTERVAL:
            if len(self._tls_logged) > 1024:  # forget peers quiet for a minute: the map stays small
                self._tls_logged = {h: t for h, t in self._tls_logged.items() if now - t < TLS_LOG_INTERVAL}
            self._tls_logged[host] = now
            logger.warning("gossip TLS handshake with %s failed (further failures of this peer counted, "
                           "logged again after %.0f s): %s", host, TLS_LOG_INTERVAL, exc)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Cancelled at shutdown, a connection callback would make asyncio log a traceback each.
        with contextlib.suppress(asyncio.CancelledError):
            await self._on_stream(reader, writer)

    async def _on_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        readexactly = reader.readexactly
        if self.tls is not None:
            peer = writer.get_extra_info("peername")
            stream = TlsServerStream(reader, writer, self.tls.server_context)
            try:
                async with asyncio.timeout(self.tls.handshake_timeout):
                    await stream.handshake()
            except (OSError, TimeoutError, EOFError) as exc:  # SSLError, a reset, the handshake timeout
                writer.close()
                self._tls_failed(str(peer[0]) if peer else "?",
                                 exc if str(exc) else TimeoutError(f"no handshake in {self.tls.handshake_timeout} s"))
                return
            if not self._peer_accepted(str(peer[0]) if peer else "?", stream.peer_certificate()):
                writer.close()
                return
            readexactly = stream.readexactly
        try:
            async with asyncio.timeout(STREAM_TIMEOUT):
                (size,) = struct.unpack(">I", await readexactly(4))
                if size > self.max_stream + 512:
                    self.stats.rejected["too_large"] += 1
                    return
                sealed = await readexactly(size)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            self.stats.rejected["malformed"] += 1
            return
        finally:
            writer.close()
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
                    tls: GossipTls | None = None, max_packet: int = MAX_PACKET,
                    max_stream: int = MAX_STREAM) -> GossipTransport:
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
                                      tls=tls)
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
