"""The listeners' connections under hostile traffic: deadlines, a cap, and an accept loop that backs off.

aiohttp's low-level server, hardened in three places:

- **Deadlines.** A request's line and headers (and body, if any) must arrive within
  ``header_timeout`` of its first byte (:class:`GuardedRequestHandler` arms a timer on the
  first byte and cancels it when the parser has a complete request), so a client that sends a
  byte at a time is closed. aiohttp's keep-alive timer, set to ``idle_timeout``, closes a
  connection that sends nothing after connecting or after an answer (its default is an hour).
- **A cap.** :class:`GuardedServer` keeps its connections ordered by their last received
  byte. Past ``max_connections`` a new connection closes the quietest one, as Knot and NSD do
  for DNS over TCP: connections parked by a flood can not lock out a monitor, and every one
  of them is gone within the deadlines anyway.
- **Accepts.** :class:`GuardedSite` accepts itself instead of leaving it to the event loop,
  because the loops disagree on descriptor exhaustion: asyncio's selector loop reports each
  failed accept to the loop's exception handler (hundreds of error lines a second) and
  retries after a second; uvloop (libuv) silently accepts and closes the waiting connections
  with its reserve descriptor, so clients see resets and nobody learns why. Here a failed
  accept (EMFILE, ENFILE, ENOBUFS, ENOMEM) stops accepting for a backoff (50 ms doubling to
  1 s), counts, and reports once per episode; waiting connections stay in the kernel's
  backlog and are served when descriptors free up. Except on EMFILE/ENFILE while a **reserve
  descriptor** is held (haproxy's and libuv's trick): it is closed to accept one waiting
  connection, whose request must already be there (a kubelet probe sends it at once): ``GET
  /livez`` is answered 200 (the process answers: a restart would not help), anything else 503
  ``descriptors exhausted``, and a connection with nothing to say is closed; then the reserve is
  taken again. So ``/livez`` keeps answering under exhaustion and idle connections parked by a
  flood are shed from the backlog.

Malformed requests reach :meth:`GuardedRequestHandler.handle_error` (aiohttp's parser error
path); the listener's ``error_response`` answers them with ``X-Region`` and ``X-Request-Id``
and logs one line through its rate limit, without aiohttp's traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from region_agent.health.metrics import ConnectionStats

__all__ = ["ErrorResponder", "GuardedRequestHandler", "GuardedServer", "GuardedSite", "errno_name"]

# (request, status, exception, message) -> the response to a request aiohttp could not parse.
ErrorResponder = Callable[[web.BaseRequest, int, BaseException | None, str | None], web.StreamResponse]

_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 1.0
_ACCEPTS_PER_WAKEUP = 64  # like asyncio's backlog loop: bounded work per readiness event
_STARVED = (errno.EMFILE, errno.ENFILE)
_HEAD_BYTES = 4096
_DEFER_ACCEPT_SECONDS = 5


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def starved_answer(head: bytes) -> bytes | None:
    """What a connection accepted on the reserve descriptor gets: 200 for ``GET /livez``, 503 for any other
    request, None (closed unanswered) when it has sent nothing yet."""
    if not head:
        return None
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    ok = len(parts) == 3 and parts[0] == b"GET" and parts[1].split(b"?", 1)[0] == b"/livez"
    status, body = (b"200 OK", b"ok") if ok else (b"503 Service Unavailable", b"descriptors exhausted")
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


class GuardedRequestHandler(RequestHandler):
    """aiohttp's protocol with a request-read deadline, activity tracking and our 400s."""

    __slots__ = ("_guard", "_read_deadline")

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._read_deadline: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        super().data_received(data)
        guard = self._guard
        guard.touch(self)
        if self._request_count != before:  # the parser completed a request: it came in time
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None
        elif data and self._read_deadline is None and self.transport is not None:
            self._read_deadline = self._loop.call_later(guard.header_timeout, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport is not None:
            self._guard.stats.closed["header-timeout"] += 1
            self.force_close()

    def _process_keepalive(self) -> None:
        # aiohttp's idle timer; wrapped only to count the connections it closes.
        was_open = self.transport is not None
        super()._process_keepalive()
        if was_open and self.transport is None:
            self._guard.stats.closed["idle-timeout"] += 1

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp could not parse (400), or a handler that failed: answered by the listener."""
        if request.writer.output_size > 0:  # part of an answer is out: nothing sane to add
            raise ConnectionError("response already started, can not send an error answer")
        response = self._guard.error_response(request, status, exc, message)
        response.force_close()
        return response


class GuardedServer(web.Server):
    """``web.Server`` whose connections are :class:`GuardedRequestHandler`, capped, quietest evicted."""

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Any],
        *,
        header_timeout: float,
        max_connections: int,
        stats: ConnectionStats,
        error_response: ErrorResponder,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.stats = stats
        self.error_response = error_response
        self._loop_ref = asyncio.get_running_loop()
        # Live connections, least recently active first (move_to_end on every read).
        self._quiet: OrderedDict[RequestHandler, None] = OrderedDict()

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop_ref, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        quiet = self._quiet
        quiet[handler] = None
        if len(quiet) > self.max_connections:
            victim, _ = quiet.popitem(last=False)  # never the newcomer: it is last
            self.stats.closed["cap"] += 1
            victim.force_close()
        self.stats.open = len(quiet)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self._quiet.pop(handler, None)
        self.stats.open = len(self._quiet)

    def touch(self, handler: RequestHandler) -> None:
        if handler in self._quiet:
            self._quiet.move_to_end(handler)


class _Acceptor(asyncio.AbstractServer):
    """Accepts on one listening socket from a reader callback; backs off when accept fails."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        *,
        on_error: Callable[[OSError], None],
        on_recovered: Callable[[], None],
    ) -> None:
        self._sock = sock
        self._factory = factory
        self._on_error = on_error
        self._on_recovered = on_recovered
        self._loop = asyncio.get_running_loop()
        self._backoff = _BACKOFF_FIRST
        self._failing = False
        self._retry: asyncio.TimerHandle | None = None
        self._adopting: set[asyncio.Task[None]] = set()
        self._closed = False
        self._reserve = _open_reserve()
        self._deferring = False
        self._stats: ConnectionStats | None = getattr(factory, "stats", None)   # a GuardedServer's

    def start(self) -> None:
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                conn, _address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the client gave up while waiting: next one
                continue
            except OSError as exc:
                if exc.errno in _STARVED and self._reserve is not None:
                    self._failing = True
                    self._on_error(exc)
                    self._defer_accept(True)
                    accepted = self._answer_on_reserve()
                    if accepted:
                        continue
                    if accepted is None and self._reserve is not None:
                        return   # nothing was waiting after all
                self._pause(exc)   # another error, or the reserve is gone: back off, do not spin
                return
            if self._failing:
                if self._reserve is None:
                    self._reserve = _open_reserve()   # lost in a starved moment: take it again now there is room
                self._defer_accept(False)
                self._failing = False
                self._backoff = _BACKOFF_FIRST
                self._on_recovered()
            conn.setblocking(False)
            task = self._loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _defer_accept(self, on: bool) -> None:
        """While starved, the kernel queues a new connection only once its request has arrived (Linux
        TCP_DEFER_ACCEPT): the reserve path then finds it there, and idle ones wait in the kernel instead
        of in front of a probe. Off again once accepts work (idle connections are the cap's to shed)."""
        if on != self._deferring and hasattr(socket, "TCP_DEFER_ACCEPT"):
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, _DEFER_ACCEPT_SECONDS if on else 0)
                self._deferring = on

    def _answer_on_reserve(self) -> bool | None:
        """Free the reserve descriptor, accept one connection on it, answer it at once and close it
        (:func:`starved_answer`), take the reserve again. True: one answered or shed; None: nothing was
        waiting; False: the accept failed (ENOMEM, ENOBUFS: the caller backs off)."""
        assert self._reserve is not None
        os.close(self._reserve)
        self._reserve = None
        try:
            conn, _address = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            self._reserve = _open_reserve()
            return None
        except OSError:
            self._reserve = _open_reserve()
            return False
        try:
            conn.setblocking(False)
            try:
                answer = starved_answer(conn.recv(_HEAD_BYTES))
            except (BlockingIOError, InterruptedError):
                answer = None
            if answer is not None:
                conn.send(answer)   # a few dozen bytes: the socket buffer takes them whole
            if self._stats is not None:
                self._stats.closed["reserve-answered" if answer is not None else "reserve-shed"] += 1
        except OSError:
            pass
        finally:
            conn.close()
            self._reserve = _open_reserve()
        return True

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:
            conn.close()
            self._on_error(exc)

    def _pause(self, exc: OSError) -> None:
        self._failing = True
        self._loop.remove_reader(self._sock.fileno())
        self._retry = self._loop.call_later(self._backoff, self._resume)
        self._backoff = min(_BACKOFF_MAX, self._backoff * 2)
        self._on_error(exc)

    def _resume(self) -> None:
        self._retry = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._on_readable)

    # --- asyncio.AbstractServer -------------------------------------------------------------

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return () if self._closed else (self._sock,)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None

    async def wait_closed(self) -> None:
        if self._adopting:
            await asyncio.gather(*self._adopting, return_exceptions=True)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return not self._closed

    async def start_serving(self) -> None:
        return None

    async def serve_forever(self) -> None:
        raise NotImplementedError("GuardedSite serves from start(); nothing to run forever")


class GuardedSite(web.BaseSite):
    """A TCP site that binds its own socket and accepts through :class:`_Acceptor`."""

    __slots__ = ("_host", "_on_error", "_on_recovered", "_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        backlog: int,
        on_error: Callable[[OSError], None],
        on_recovered: Callable[[], None],
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._on_error = on_error
        self._on_recovered = on_recovered

    @property
    def name(self) -> str:
        return f"http://[{self._host}]:{self._port}" if ":" in self._host else f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # setup() ran: BaseSite checked it
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # create_server: SO_REUSEADDR (restart while old connections linger), IPv6 v6-only.
        sock = socket.create_server((self._host, self._port), family=family, backlog=self._backlog)
        sock.setblocking(False)
        acceptor = _Acceptor(sock, server, on_error=self._on_error, on_recovered=self._on_recovered)
        self._server = acceptor
        acceptor.start()


def errno_name(exc: OSError) -> str:
    """``EMFILE`` and the like, for a bounded metric label."""
    return errno.errorcode.get(exc.errno or 0, "other")

