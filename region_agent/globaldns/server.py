"""UDP and TCP listeners around a :class:`Responder`.

UDP is answered straight from the socket, without an asyncio transport: when the loop says it
is readable, :class:`UdpListener` reads what the socket holds, at most ``UDP_BATCH`` datagrams
per turn so nothing else on the loop waits long, answers each and sends the answers: one loop
callback per burst instead of one per datagram, no task, no await. On Linux the reads and sends
are batched, one ``recvmmsg`` and one ``sendmmsg`` per burst (:class:`_Mmsg`, through ctypes:
the standard library has neither), since most of a memo hit's cost is the kernel's per-call
work; elsewhere it is ``recvfrom`` until ``EAGAIN`` and one ``sendto`` per answer. A response
the kernel will not take (a full send buffer) is dropped, as UDP may.

TCP (RFC 7766) reads length-prefixed messages and answers them in arrival order (pipelined
queries are allowed) with the length and message written together. What one connection can
cost is bounded (RFC 7766 §6.2, RFC 9210 §4), each bound a :class:`TcpLimits` field:

- memory: reads go through one shared 16 KiB buffer into the connection's own, and once the
  answers the kernel has not yet taken exceed ``write_buffer`` bytes the connection is neither
  read nor answered until they drain to a quarter of that (a client that never reads costs
  about ``write_buffer`` plus one read, not a copy of everything it sent);
- time on the loop: at most ``max_in_flight`` of its queries are answered in one go; the rest
  wait, unread, for the next loop turn, so UDP and other connections get their turn;
- a slot: ``idle_timeout`` after its last *complete* message (the bytes of an unfinished one
  do not count, so a trickle can not keep it open), or ``message_timeout`` after the first
  byte of a message that is still incomplete, the connection is closed; one source (an IPv4
  address or an IPv6 /64) may hold ``max_per_source`` connections, and when all
  ``max_connections`` are taken the longest-idle one is closed for the newcomer (as Knot and
  NSD do) rather than the newcomer refused.

A message the server will not answer ends the connection, since the framing can not be
trusted any more, but only after the answers to the messages before it have been written.
Every refusal and close is counted by reason in :class:`DnsCounters`.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import mmap
import os
import socket
import struct
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, cast

from region_agent.base.sockets import set_port_sharing, source_key
from region_agent.globaldns.answer import AnswerLater, Responder
from region_agent.globaldns.metrics import DnsCounters

logger = logging.getLogger("region_agent.dns")
_LENGTH = struct.Struct("!H")
_READ_CHUNK = 16 * 1024  # one read; also the most unanswered bytes a paused connection holds, beyond one message


@dataclass
class TcpLimits:
    idle_timeout: float = 10.0
    message_timeout: float = 3.0
    max_connections: int = 512
    max_per_source: int = 16
    write_buffer: int = 16 * 1024
    max_in_flight: int = 32


_BIND_REASONS = {
    errno.EADDRINUSE: "address already in use (another process holds this port)",
    errno.EADDRNOTAVAIL: "address not available on this host",
    errno.EACCES: "permission denied (ports below 1024 need CAP_NET_BIND_SERVICE)",
}


class BindError(OSError):
    """A listening address the DNS server could not bind: a start-up error naming the setting."""

    def __init__(self, host: str, port: int, transport: str, error: OSError) -> None:
        super().__init__(error.errno, error.strerror)
        address_problem = error.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
        self.setting = "dns.listen_addresses" if address_problem else "dns.port"
        self.address = f"{host} port {port}/{transport}"
        self.reason = _BIND_REASONS.get(error.errno or 0, error.strerror or str(error))

    def __str__(self) -> str:
        return f"{self.setting}: can not listen on {self.address}: {self.reason}"


UDP_BATCH = 64  # datagrams answered per readiness callback at most
UDP_MAX_QUERY = 65535  # bytes read per datagram: any UDP payload, as the transport read
_SLOT = 65536  # bytes per datagram in the batch buffers (a query and a response of any UDP size)


def udp_socket(host: str, port: int, *, share: bool = False) -> socket.socket:
    """A bound, non-blocking UDP socket for one listening address; :class:`BindError` if it can not be.

    ``SO_REUSEADDR`` off and ``SO_REUSEPORT`` off, so no other process can bind the same address
    and port and take part of the queries (nor start silently beside us); ``share``: ``SO_REUSEPORT``
    on, for the agent's own ``dns.workers`` (the kernel shares the port only among sockets of our uid).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        # A deep receive buffer absorbs bursts while the loop is busy elsewhere.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        set_port_sharing(sock, share=share)
        sock.setblocking(False)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise BindError(host, port, "udp", error) from None
    return sock


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


class _Msghdr(ctypes.Structure):
    _fields_ = (("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.c_void_p),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int))


class _Mmsghdr(ctypes.Structure):
    _fields_ = (("hdr", _Msghdr), ("len", ctypes.c_uint32))


def _libc_mmsg() -> tuple[Any, Any] | None:
    """libc's recvmmsg and sendmmsg (Linux), or None where there are none."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        recvmmsg, sendmmsg = libc.recvmmsg, libc.sendmmsg
    except (OSError, AttributeError):
        return None
    recvmmsg.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p)
    sendmmsg.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int)
    recvmmsg.restype = sendmmsg.restype = ctypes.c_int
    return recvmmsg, sendmmsg


_MMSG = _libc_mmsg()
_MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0x40)
_HDR = ctypes.sizeof(_Mmsghdr)
_IOVEC = ctypes.sizeof(_Iovec)
_LEN_AT = _Mmsghdr.len.offset
_PORT, _PORT32, _SCOPE = struct.Struct("!H"), struct.Struct("!I"), struct.Struct("=I")  # in a sockaddr
_SIZE_T = struct.Struct("@N")   # an iovec length: size_t, native order (was 4 bytes: right on little-endian only)


class _Mmsg:
    """``UDP_BATCH`` slots for recvmmsg and as many for sendmmsg, slot ``i`` of both sharing one
    address and one ``_SLOT``-byte buffer (anonymous memory: only the pages a datagram touches are
    ever used).

    Receive slot ``i`` keeps its address, iovec and length for good (the kernel writes back the
    same address length a socket of one family always has), so a call sets nothing. A query's
    response goes where the query was (a memo hit is written over it in place, a miss copied in),
    and send slot ``i`` sends buffer ``i`` to address ``i``: only its iovec's length is set. When an
    earlier datagram of the batch got no answer, a response and its address move down a slot.
    """

    def __init__(self, family: int) -> None:
        n = UDP_BATCH
        self.namelen = 16 if family == socket.AF_INET else 28  # sockaddr_in, sockaddr_in6
        self.family = family
        self.buffers = mmap.mmap(-1, n * _SLOT)
        self.data = memoryview(self.buffers)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.buffers))
        self.names = ctypes.create_string_buffer(n * self.namelen)
        self.names_view = memoryview(self.names).cast("B")
        names = ctypes.addressof(self.names)
        self.iovecs = (_Iovec * (2 * n))()
        self.recv = (_Mmsghdr * n)()
        self.send = (_Mmsghdr * n)()
        for i in range(2 * n):
            msgs, k = (self.recv, i) if i < n else (self.send, i - n)
            # Send slot k sends buffer k to receive slot k's address: the same bytes, nothing to
            # copy unless an earlier datagram of the batch got no answer (then both move down).
            self.iovecs[i].base, self.iovecs[i].len = base + k * _SLOT, _SLOT
            hdr = msgs[k].hdr
            hdr.name, hdr.namelen = names + k * self.namelen, self.namelen
            hdr.iov, hdr.iovlen = ctypes.addressof(self.iovecs[i]), 1
        # msg_len of every receive slot, in one list: a strided view of the headers as uint32
        self.lengths = memoryview(self.recv).cast("B").cast("I")[_LEN_AT // 4::_HDR // 4]
        # iov_len of every send slot's iovec, as size_t items: a strided view (one store per answer)
        # (unsigned long is size_t on Linux, LP64 and ILP32 alike: the only place recvmmsg is used)
        assert struct.calcsize("L") == _SIZE_T.size
        self.send_lengths = (memoryview(self.iovecs).cast("B")[n * _IOVEC:].cast("L")
                             [_Iovec.len.offset // _SIZE_T.size::_IOVEC // _SIZE_T.size])
        self.sources: dict[bytes, str] = {}  # address bytes → text, for Responder (bounded)
        self.keep = (base, names)  # the buffers stay exported (so mapped) while this lives

    def address(self, i: int) -> tuple[Any, ...]:
        """Receive slot ``i``'s sender as ``sendto`` takes it: (host, port) or (host, port, flowinfo, scope)."""
        at = i * self.namelen
        raw = bytes(self.names_view[at:at + self.namelen])
        (port,) = _PORT.unpack_from(raw, 2)
        if self.family == socket.AF_INET:
            return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
        (flowinfo,) = _PORT32.unpack_from(raw, 4)
        (scope,) = _SCOPE.unpack_from(raw, 24)
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port, flowinfo, scope

    def source(self, i: int) -> str:
        """The text address of receive slot ``i``'s sender, as ``recvfrom`` gives it."""
        at = i * self.namelen
        raw = bytes(self.names_view[at + 4:at + 8] if self.family == socket.AF_INET else
                    self.names_view[at + 8:at + 24])
        text = self.sources.get(raw)
        if text is None:
            if len(self.sources) >= 4096:
                self.sources.clear()
            text = self.sources[raw] = socket.inet_ntop(self.family, raw)
        return text


ERROR_LOG_EVERY = 10.0  # seconds between two tracebacks of failing answers (a bug must not flood the log)


class AnswerErrors:
    """A query whose answering raised costs that query only: counted, and logged with its traceback
    at most once every ``ERROR_LOG_EVERY`` seconds, with how many failed since the last line."""

    def __init__(self) -> None:
        self.logged_at = -ERROR_LOG_EVERY
        self.unlogged = 0

    def failed(self, counters: DnsCounters, transport: str) -> None:
        counters.answer_errors += 1
        now = time.monotonic()
        if now - self.logged_at < ERROR_LOG_EVERY:
            self.unlogged += 1
            return
        logger.exception("error answering a %s query (%d more failed since the last such line)", transport,
                         self.unlogged)
        self.logged_at, self.unlogged = now, 0


ANSWER_ERRORS = AnswerErrors()  # one per process: the log is


def _no_hit(buffer: mmap.mmap, start: int, length: int) -> int:
    """The hitter while no query can be a memo hit (``Responder.udp_hitter``): it declines."""
    return 0


class UdpListener:
    """Answers one UDP socket from the loop's readiness callback (no transport, see the module doc)."""

    def __init__(self, sock: socket.socket, responder: Responder) -> None:
        self.sock = sock
        self.responder = responder
        self.miss = responder.udp_miss
        self.answering: int | tuple[Any, ...] = -1  # the datagram on the miss path: its receive slot, or its address
        self.loop = asyncio.get_running_loop()
        self.fd = sock.fileno()
        self.mmsg = _Mmsg(sock.family) if _MMSG is not None else None
        self.buffer = mmap.mmap(-1, _SLOT) if self.mmsg is None else None  # recvfrom's, answered in place
        self.loop.add_reader(self.fd, self._readable if self.mmsg is None else self._readable_batched)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """As a transport's: ``socket`` is the listening socket."""
        return self.sock if name == "socket" else default

    def _readable_batched(self) -> None:
        """One recvmmsg of up to ``UDP_BATCH`` datagrams, their answers in one sendmmsg."""
        assert self.mmsg is not None and _MMSG is not None
        count = _MMSG[0](self.fd, self.mmsg.recv, UDP_BATCH, _MSG_DONTWAIT, None)
        if count <= 0:
            error = ctypes.get_errno()
            if count < 0 and error not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                logger.debug("UDP receive error: %s", os.strerror(error))
            return
        sending = self._answer_batch(count)
        if sending:
            self._send_batch(sending)

    def _answer_batch(self, count: int) -> int:
        """Answer receive slots ``0..count-1`` into the send slots; how many answers are there to send.

        Per datagram: the memo, in place (``udp_hitter``), and only on a miss its bytes (one slice
        of the mapped buffers) and the whole answer path (``udp_miss``), which converts the sender's
        address to text only if it reads it (``answer.Source``).
        """
        mmsg = self.mmsg
        assert mmsg is not None
        started = time.perf_counter()
        hit = self.responder.udp_hitter() or _no_hit
        miss, source, later = self.miss, self.answering_source, self.later
        buffers, names, namelen, send_lengths = mmsg.buffers, mmsg.names_view, mmsg.namelen, mmsg.send_lengths
        sending = start = 0
        for i, length in enumerate(mmsg.lengths[:count].tolist()):
            at = start
            start += _SLOT
            try:
                size = hit(buffers, at, length)
                if not size:
                    self.answering = i
                    out = miss(buffers[at:at + length], source, later)
                    if out is None:
                        continue
                    size = len(out)  # at most 65,535 bytes: UDP's bound, within a slot
                    buffers[at:at + size] = out  # where the query was: it is read
            except Exception:  # a bug must cost one query, never the listener
                ANSWER_ERRORS.failed(self.responder.counters, "UDP")
                continue
            if sending != i:  # an earlier one got no answer: this answer and its address move down a slot
                down = sending * _SLOT
                buffers[down:down + size] = buffers[at:at + size]
                names[sending * namelen:(sending + 1) * namelen] = names[i * namelen:(i + 1) * namelen]
            send_lengths[sending] = size
            sending += 1
        self.responder.counters.observe((time.perf_counter() - started) / count)  # one sample per batch: its mean
        return sending

    def _send_batch(self, sending: int) -> None:
        """sendmmsg the first ``sending`` send slots.

        sendmmsg stops at the first answer the kernel refuses (a full buffer, or a source it can not
        send to: port 0, unroutable): that one is skipped and the rest still go, unless the buffer is full.
        """
        assert self.mmsg is not None and _MMSG is not None
        sendmmsg = _MMSG[1]
        done, first = 0, ctypes.addressof(self.mmsg.send)
        while done < sending:
            sent = sendmmsg(self.fd, first + done * _HDR, sending - done, _MSG_DONTWAIT)
            if sent > 0:
                done += sent
                continue
            error = ctypes.get_errno()
            if error in (errno.EAGAIN, errno.EWOULDBLOCK):
                logger.debug("UDP send buffer full: %d of %d answers lost", sending - done, sending)
                break
            logger.debug("UDP send: one answer not sent (%s)", os.strerror(error))
            done += 1

    def _readable(self) -> None:
        """Without recvmmsg: recvfrom until EAGAIN (at most ``UDP_BATCH``), one sendto per answer."""
        recvfrom_into = self.sock.recvfrom_into
        sendto = self.sock.sendto
        hit = self.responder.udp_hitter() or _no_hit
        miss, later = self.miss, self.later
        buffer = self.buffer
        assert buffer is not None
        view = memoryview(buffer)
        for _ in range(UDP_BATCH):
            try:
                length, addr = recvfrom_into(buffer, UDP_MAX_QUERY)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # an error queued on the socket: reported once, then reading goes on
                logger.debug("UDP receive error: %s", error)
                continue
            started = time.perf_counter()
            try:
                size = hit(buffer, 0, length)
                if size:
                    out: bytes | memoryview | None = view[:size]
                else:
                    self.answering = addr
                    out = miss(buffer[:length], addr[0], later)
            except Exception:  # a bug must cost one query, never the listener
                ANSWER_ERRORS.failed(self.responder.counters, "UDP")
                continue
            self.responder.counters.observe(time.perf_counter() - started)
            if out is not None:
                try:
                    sendto(out, addr)
                except OSError as error:  # a full send buffer, an unroutable source: this answer is lost
                    logger.debug("UDP send error to %s: %s", addr[0], error)

    def answering_source(self) -> str:
        """The text address of the datagram on the miss path (``answer.Source``: converted when read)."""
        answering = self.answering
        if isinstance(answering, tuple):
            return str(answering[0])
        assert self.mmsg is not None
        return self.mmsg.source(answering)

    def later(self) -> AnswerLater:
        """Where to send the answer to the datagram on the miss path, when it is ready (``AnswerLater``)."""
        answering, sock = self.answering, self.sock
        if isinstance(answering, tuple):
            addr = answering
        else:
            assert self.mmsg is not None and answering >= 0
            addr = self.mmsg.address(answering)

        def send(out: bytes) -> None:
            if sock.fileno() < 0:
                return  # the listener closed (stopping)
            try:
                sock.sendto(out, addr)
            except OSError as error:  # a full send buffer, an unroutable source: lost, as UDP may
                logger.debug("UDP send error to %s: %s", addr[0], error)

        return send

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            self.fd = -1
            self.sock.close()


class TcpProtocol(asyncio.BufferedProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.limits = server.tcp
        self.loop = asyncio.get_running_loop()
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.source = ""
        self.last_message = 0.0  # loop time of the last complete message (or of the accept)
        self.message_started: float | None = None  # first byte of a message still arriving
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = 0.0  # when the timer fires (uvloop's TimerHandle.when() is rounded to its clock)
        self.continuation: asyncio.Handle | None = None  # the next batch of queries, next loop turn
        self.writing_paused = False
        self.reading = True
        self.eof = False
        self.ended: str | None = None  # why the server ended it, once it has
        self.deferred = False  # the message being answered is answered later (``later``)

    # --- transport callbacks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = self.transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else ""
        self.source = source_key(self.peer)
        if not self.server.admit(self):
            self.ended = "refused"
            self.transport.close()
            return
        high = self.limits.write_buffer
        self.transport.set_write_buffer_limits(high=high, low=high // 4)
        self.last_message = self.loop.time()
        self._arm()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.server.read_buffer  # shared: buffer_updated follows each read at once

    def buffer_updated(self, nbytes: int) -> None:
        if self.ended is not None:
            return  # closing: nothing it sends now will be answered
        self.buffer += self.server.read_buffer[:nbytes]
        if self.continuation is None and not self.writing_paused:
            self._process()

    def eof_received(self) -> bool:
        self.eof = True  # answer what is complete, then close (see _settle)
        if self.ended is None and self.continuation is None and not self.writing_paused:
            self._settle()
        return True  # the server closes its side itself

    def pause_writing(self) -> None:
        self.writing_paused = True
        self.server.responder.counters.tcp_read_pauses["write_buffer"] += 1
        self._set_reading(False)

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.ended is None and self.continuation is None:
            self.continuation = self.loop.call_soon(self._process)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.ended is None:
            self.ended = "client"
            self.server.responder.counters.tcp_closed["client"] += 1
        self._cancel_timers()
        self.server.forget(self)
        self.buffer = bytearray()

    # --- answering ----------------------------------------------------------------------

    def _complete_message_buffered(self) -> bool:
        buffer = self.buffer
        return len(buffer) >= 2 and len(buffer) >= 2 + _LENGTH.unpack_from(buffer)[0]

    def _process(self) -> None:
        """Answer up to ``max_in_flight`` complete messages from the buffer, then settle."""
        self.continuation = None
        if self.ended is not None or self.transport is None or self.writing_paused:
            return
        respond = self.server.responder.respond
        buffer = self.buffer
        out = bytearray()
        answered = 0
        offset = 0
        bad = False
        while answered < self.limits.max_in_flight and len(buffer) - offset >= 2:
            (length,) = _LENGTH.unpack_from(buffer, offset)
            end = offset + 2 + length
            if len(buffer) < end:
                break
            message = bytes(buffer[offset + 2:end])
            offset = end
            self.deferred = False
            try:
                response = respond(message, self.peer, tcp=True, later=self.later)
            except Exception:
                ANSWER_ERRORS.failed(self.server.responder.counters, "TCP")
                response = None
            if response is None:
                if self.deferred:  # it is answered when its answer is ready (out of order)
                    answered += 1
                    continue
                bad = True
                break
            out += _LENGTH.pack(len(response))
            out += response
            answered += 1
        del buffer[:offset]
        if offset:
            self.last_message = self.loop.time()
            self.message_started = None
            self.server.touch(self)
        if out:
            self.transport.write(out)  # may call pause_writing before it returns
        if bad:
            self.end("bad_message", flush=True)  # the answers before it still go out
            return
        self._settle()

    def later(self) -> AnswerLater:
        """The message being answered is answered when ready, on this connection if it is still open."""
        self.deferred = True
        return self._send_later

    def _send_later(self, out: bytes) -> None:
        if self.ended is None and self.transport is not None and not self.transport.is_closing():
            self.transport.write(_LENGTH.pack(len(out)) + out)

    def _settle(self) -> None:
        """After a batch: schedule the next one or read again, re-arm the deadline, or close at EOF."""
        complete = self._complete_message_buffered()
        if self.buffer and not complete and not self.writing_paused:
            if self.message_started is None:
                self.message_started = self.loop.time()
        else:
            self.message_started = None  # while it waits on us the clock is not the client's
        if complete and not self.writing_paused:
            self.continuation = self.loop.call_soon(self._process)
            if self.reading:
                self.server.responder.counters.tcp_read_pauses["in_flight"] += 1
            self._set_reading(False)
        elif self.eof and not complete:
            self.end("client", flush=True)  # it sent all it will send, and all of it is answered
            return
        else:
            self._set_reading(not self.writing_paused)
        self._arm()

    # --- reading, deadlines, closing ----------------------------------------------------

    def _set_reading(self, reading: bool) -> None:
        if reading == self.reading or self.transport is None or self.ended is not None or (reading and self.eof):
            return
        self.reading = reading
        if reading:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    def _arm(self) -> None:
        deadline = self.last_message + self.limits.idle_timeout
        if self.message_started is not None:
            deadline = min(deadline, self.message_started + self.limits.message_timeout)
        if self.timer is not None:
            if self.deadline == deadline:
                return  # a trickle of bytes moves nothing
            self.timer.cancel()
        self.deadline = deadline
        self.timer = self.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.timer = None
        if self.ended is not None:  # answers flushing to a client that does not read them
            self.shut_now()
            return
        started = self.message_started
        # Which deadline fired, from the deadlines themselves: uvloop's clock has millisecond steps.
        late = started is not None and (started + self.limits.message_timeout
                                         < self.last_message + self.limits.idle_timeout)
        self.end("message_timeout" if late else "idle")

    def end(self, reason: str, *, flush: bool = False) -> None:
        """Close for ``reason``, counted once (eviction, shutdown, timeouts, a bad message).

        ``flush``: what is already written still goes out, within ``message_timeout``.
        """
        if self.ended is None:
            self.ended = reason
            self.server.responder.counters.tcp_closed[reason] += 1
        elif flush:
            return  # already on its way out
        if self.continuation is not None:
            self.continuation.cancel()
            self.continuation = None
        if flush and self.transport is not None and self.transport.get_write_buffer_size():
            # It keeps its slot (and stays evictable) until the answers are gone or the deadline passes.
            self.transport.close()
            if self.timer is not None:
                self.timer.cancel()
            self.deadline = self.loop.time() + self.limits.message_timeout
            self.timer = self.loop.call_at(self.deadline, self._expire)
            return
        self.shut_now()

    def shut_now(self) -> None:
        """Give up the slot at once; unsent answers are dropped (RST) rather than waited for."""
        self.server.forget(self)
        self._cancel_timers()
        if self.transport is None:
            return
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()

    def _cancel_timers(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.continuation is not None:
            self.continuation.cancel()
            self.continuation = None


class DnsServer:
    """Owns the sockets; ``start`` binds every address, ``stop`` closes them."""

    def __init__(self, responder: Responder, addresses: list[tuple[str, int]], tcp: TcpLimits | None = None,
                 share_port: bool = False) -> None:
        """``share_port``: SO_REUSEPORT on UDP and TCP, for the agent's own ``dns.workers`` (same uid only)."""
        self.responder = responder
        self.share_port = share_port
        self.addresses = addresses
        self.tcp = tcp or TcpLimits()
        # Open connections, least recently active first: the one to close when all slots are taken.
        self.connections: OrderedDict[TcpProtocol, None] = OrderedDict()
        self.per_source: Counter[str] = Counter()
        self.read_buffer = memoryview(bytearray(_READ_CHUNK))
        self._udp: list[UdpListener] = []
        self._tcp: list[asyncio.Server] = []
        self.bound: list[tuple[str, int]] = []

    # --- TCP connection slots -----------------------------------------------------------

    def admit(self, connection: TcpProtocol) -> bool:
        """Take a slot for a new connection, closing the longest-idle one if all are taken."""
        counters = self.responder.counters
        if self.per_source[connection.source] >= self.tcp.max_per_source:
            counters.tcp_refused["source_limit"] += 1
            return False
        while len(self.connections) >= self.tcp.max_connections:
            next(iter(self.connections)).end("evicted")
        self.connections[connection] = None
        self.per_source[connection.source] += 1
        counters.tcp_connections += 1
        counters.tcp_open = len(self.connections)
        return True

    def touch(self, connection: TcpProtocol) -> None:
        if connection in self.connections:
            self.connections.move_to_end(connection)

    def forget(self, connection: TcpProtocol) -> None:
        """Give back its slot (once; later calls do nothing)."""
        if connection not in self.connections:
            return
        del self.connections[connection]
        self.per_source[connection.source] -= 1
        if self.per_source[connection.source] <= 0:
            del self.per_source[connection.source]
        self.responder.counters.tcp_open = len(self.connections)

    # --- sockets ------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind every address; a failure is a :class:`BindError` naming the setting to change."""
        for host, port in self.addresses:
            # Port 0 (tests, benches): the kernel picks a free UDP port, which another process
            # may hold for TCP; pick again rather than fail. A configured port fails at once.
            for attempt in range(1 if port else 20):
                try:
                    await self._bind(host, port)
                    break
                except BindError as error:
                    if port or error.errno != errno.EADDRINUSE or attempt == 19:
                        raise

    async def _bind(self, host: str, port: int) -> None:
        """UDP and TCP on one (host, port), or neither: a half-bound address is undone."""
        loop = asyncio.get_running_loop()
        sock = udp_socket(host, port, share=self.share_port)  # no event loop transport: nothing turns options on
        actual_port = sock.getsockname()[1]
        transport = UdpListener(sock, self.responder)
        try:
            # TCP keeps SO_REUSEADDR so a restart is not refused by the last run's TIME_WAIT sockets;
            # on Linux it does not let a second listener share the port.
            server = await loop.create_server(lambda: TcpProtocol(self), host, actual_port, reuse_address=True,
                                              reuse_port=self.share_port or None, backlog=512)
        except OSError as error:
            transport.close()
            raise BindError(host, actual_port, "tcp", error) from None
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
            connection.end("shutdown")
        for server in self._tcp:
            await server.wait_closed()
        self._udp.clear()
        self._tcp.clear()
