"""The real transport: encrypted UDP datagrams and encrypted one-message TCP streams on one port.

Every datagram is sealed by the :class:`~agent.gossip.keyring.Keyring` and at most
``max_packet`` bytes (1,400: below the internet's path MTU); a bigger one is refused, never
fragmented. Push-pull messages go over TCP to the same port: one connection per message, framed
as ``length (4 bytes) | sealed(sender host str8 | sender port u16 | message)``. The sender's
advertised address travels inside the sealed part because a TCP peer's port is ephemeral, and the
reply must reach its gossip port. (Mutual TLS for streams is a later step of issue 9; until then
streams are protected by the same keyring as datagrams.)

Datagrams and streams that fail to open are counted in ``stats.rejected`` by reason (``key``,
``version``, ``malformed``, ``too_large``) and dropped. The receiver's methods are called from the
event loop and never block (see :class:`~agent.gossip.membership.Membership`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import struct
from typing import Any, Protocol

from agent.gossip.keyring import OVERHEAD, Keyring, KeyringError
from agent.gossip.messages import Address, MessageError
from agent.gossip.stats import GossipStats

logger = logging.getLogger("region_agent.gossip")

MAX_PACKET = 1400
STREAM_TIMEOUT = 10.0


class PacketTooLargeError(ValueError):
    """A datagram over the size bound: the caller must split it or use a stream."""


class Receiver(Protocol):
    def receive_packet(self, data: bytes, source: Address) -> None: ...

    def receive_stream(self, data: bytes, source: Address) -> None: ...


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, owner: UdpTransport) -> None:
        self._owner = owner

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self._owner._on_datagram(data, str(addr[0]), int(addr[1]))

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable and the like: the peer is gone, which probes will find out.
        logger.debug("gossip UDP error: %s", exc)


class UdpTransport:
    """Bind with :meth:`start`, hand it to a Membership, then :meth:`attach` the membership."""

    def __init__(self, addr: Address, keyring: Keyring, stats: GossipStats, *, max_packet: int = MAX_PACKET,
                 max_stream: int = 8 * 1024 * 1024) -> None:
        self.addr = addr
        self.keyring = keyring
        self.stats = stats
        self.max_packet = max_packet
        self.max_stream = max_stream
        self.overhead = OVERHEAD
        self._receiver: Receiver | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def start(cls, host: str, port: int, keyring: Keyring, stats: GossipStats, **kwargs: Any) -> UdpTransport:
        """Listen for UDP and TCP on ``host:port``; port 0 picks one that is free for both."""
        loop = asyncio.get_running_loop()
        for _ in range(20):
            udp_sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
            udp_sock.bind((host, port))
            chosen = udp_sock.getsockname()[1]
            self = cls(Address(host, chosen), keyring, stats, **kwargs)
            try:
                self._server = await asyncio.start_server(self._on_stream, host, chosen, reuse_address=True)
            except OSError:
                udp_sock.close()
                if port:
                    raise
                continue  # the TCP side of that port is taken: try another
            udp, _ = await loop.create_datagram_endpoint(functools.partial(_Datagrams, self), sock=udp_sock)
            self._udp = udp
            return self
        raise OSError(f"no port free for both UDP and TCP on {host}")

    def attach(self, receiver: Receiver) -> None:
        self._receiver = receiver

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- datagrams ------------------------------------------------------------------------------

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

    # --- streams --------------------------------------------------------------------------------

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
                _, writer = await asyncio.open_connection(addr.host, addr.port)
                writer.write(struct.pack(">I", len(sealed)) + sealed)
                await writer.drain()
        except (OSError, TimeoutError) as exc:
            # The peer is unreachable: the probes decide what that means, not the stream.
            logger.debug("gossip stream to %s failed: %s", addr, exc)
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    async def _on_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(STREAM_TIMEOUT):
                (size,) = struct.unpack(">I", await reader.readexactly(4))
                if size > self.max_stream + 512:
                    self.stats.rejected["too_large"] += 1
                    return
                sealed = await reader.readexactly(size)
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
