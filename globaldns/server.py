"""UDP and TCP listeners around a :class:`Responder`.

UDP answers in the datagram callback: no task, no await, so a query costs one callback.
TCP (RFC 7766) reads length-prefixed messages, answers each as soon as it is complete
(pipelined queries are answered in arrival order, which the RFC allows), writes the
length and message together, closes idle connections after ``idle_timeout`` and refuses
connections beyond ``max_connections`` by closing them at once.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
from dataclasses import dataclass
from typing import cast

from globaldns.answer import Responder

logger = logging.getLogger("region_agent.dns")
_LENGTH = struct.Struct("!H")


@dataclass
class TcpLimits:
    idle_timeout: float = 10.0
    max_connections: int = 512


class UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, responder: Responder) -> None:
        self.respond = responder.respond
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        try:
            out = self.respond(data, str(addr[0]), tcp=False)
        except Exception:  # a bug must cost one query, never the listener
            logger.exception("error answering a UDP query")
            return
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("UDP error: %s", exc)


class TcpProtocol(asyncio.Protocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = self.transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else ""
        counters = self.server.responder.counters
        if len(self.server.connections) >= self.server.tcp.max_connections:
            counters.tcp_refused += 1
            self.transport.close()
            return
        counters.tcp_connections += 1
        self.server.connections.add(self)
        self._arm_idle()

    def _arm_idle(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
        loop = asyncio.get_running_loop()
        self.idle = loop.call_later(self.server.tcp.idle_timeout, self._close)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._arm_idle()
        out = bytearray()
        while len(self.buffer) >= 2:
            (length,) = _LENGTH.unpack_from(self.buffer)
            if len(self.buffer) < 2 + length:
                break
            message = bytes(self.buffer[2:2 + length])
            del self.buffer[:2 + length]
            try:
                response = self.server.responder.respond(message, self.peer, tcp=True)
            except Exception:
                logger.exception("error answering a TCP query")
                response = None
            if response is None:
                self._close()  # garbage on a stream: the framing can not be trusted any more
                return
            out += _LENGTH.pack(len(response)) + response
        if out and self.transport is not None:
            self.transport.write(bytes(out))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.idle is not None:
            self.idle.cancel()
        self.server.connections.discard(self)


class DnsServer:
    """Owns the sockets; ``start`` binds every address, ``stop`` closes them."""

    def __init__(self, responder: Responder, addresses: list[tuple[str, int]], tcp: TcpLimits | None = None) -> None:
        self.responder = responder
        self.addresses = addresses
        self.tcp = tcp or TcpLimits()
        self.connections: set[TcpProtocol] = set()
        self._udp: list[asyncio.DatagramTransport] = []
        self._tcp: list[asyncio.Server] = []
        self.bound: list[tuple[str, int]] = []

    async def start(self) -> None:
        for host, port in self.addresses:
            # Port 0 (tests, benches): the kernel picks a free UDP port, which another process
            # may hold for TCP; pick again rather than fail. A configured port fails at once.
            for attempt in range(1 if port else 20):
                try:
                    await self._bind(host, port)
                    break
                except OSError as error:
                    if port or error.errno != errno.EADDRINUSE or attempt == 19:
                        raise

    async def _bind(self, host: str, port: int) -> None:
        """UDP and TCP on one (host, port), or neither: a half-bound address is undone."""
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        # A deep receive buffer absorbs bursts while the loop is busy elsewhere.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        actual_port = sock.getsockname()[1]
        transport, _ = await loop.create_datagram_endpoint(lambda: UdpProtocol(self.responder), sock=sock)
        try:
            server = await loop.create_server(lambda: TcpProtocol(self), host, actual_port, reuse_address=True,
                                              backlog=512)
        except OSError:
            transport.close()
            await asyncio.sleep(0)  # the transport closes its socket on the next loop turn
            raise
        self._udp.append(transport)
        self._tcp.append(server)
        self.bound.append((host, actual_port))
        logger.info("DNS listening on %s port %d (UDP and TCP)", host, actual_port)

    async def stop(self) -> None:
        for transport in self._udp:
            transport.close()
        for server in self._tcp:
            server.close()
        for connection in list(self.connections):
            connection._close()
        for server in self._tcp:
            await server.wait_closed()
        self._udp.clear()
        self._tcp.clear()
