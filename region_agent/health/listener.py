"""The health listeners: aiohttp on port 8086 (public) and 8087 (operator), answering from a :class:`ViewSource`.

This is a hot path (DNS servers and monitors of every region poll it), so it is built on
aiohttp's low-level ``web.Server`` + ``ServerRunner`` instead of an ``Application``: one
handler dispatching on a handful of fixed paths skips the router, middlewares and signals
(``bench/health_listener.py`` measures both, modes ``bare`` and ``bare-app``). The
answers come from :mod:`region_agent.health.views` (pure); per request the listener only reads the
source, validates or makes a request id, builds a small header dict and counts into plain
ints (:mod:`region_agent.health.metrics`). aiohttp's access log is off; :mod:`region_agent.health.access_log` decides
what to log. Catch-all dispatch also means a 404 or 405 carries ``X-Region`` and
``X-Request-Id`` like every other answer, and so does the 400 of a request aiohttp could not
parse (:mod:`region_agent.health.connections`, which also bounds connections and their timing).

Two roles (:class:`Role`):

- ``public`` (8086, every address): ``/global-health/<slug>``, ``/health/region``, ``/livez``,
  ``/readyz``, with reason *codes* only (no condition messages, namespaces, revision names);
  anything else is 404;
- ``operator`` (8087, loopback by default): the same paths with every detail, ``/metrics``
  (rendered at most once per ``metrics_cache_seconds``) and the documents it is given (the
  agent's ``/zone``, rendered once per zone generation); with ``operator_token_file`` set,
  every path but ``/livez``, ``/readyz`` and ``/status`` (the status page's static HTML, whose data is
  a document) needs ``Authorization: Bearer <token>``.
  ``handlers`` hands whole path prefixes to another handler (the control API under ``/v1/``),
  which then answers every method, does its own authentication and sets its own headers;
  the listener only counts (kind ``api``) and logs them.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import resource
import time
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from region_agent.base.bearer import BearerToken
from region_agent.base.clock import Clock, SystemClock
from region_agent.base.names import region_name
from region_agent.base.request_ids import RequestIds
from region_agent.base.tracing import request_spans
from region_agent.health import status_page, views
from region_agent.health.access_log import LOGGER_NAME, RequestLog, TokenBucket
from region_agent.health.connections import GuardedServer, GuardedSite, errno_name
from region_agent.health.metrics import ListenerMetrics, RequestStats
from region_agent.health.operator import Document, DocumentCache, MetricsCache
from region_agent.health.settings import HealthSettings
from region_agent.health.source import ViewSource, as_source
from region_agent.health.views import Answer, CopyCounts
from region_agent.state.local import RegionView

__all__ = ["HealthListener", "ListenError", "Role"]


class Role(enum.StrEnum):
    PUBLIC = "public"
    OPERATOR = "operator"


_METHODS = frozenset(("GET", "HEAD"))
_GLOBAL = "/global-health/"
_GLOBAL_LEN = len(_GLOBAL)
_PUBLIC_KINDS = {"/health/region": "region", "/livez": "livez", "/readyz": "readyz"}
# /status: the status page, static bytes served without the token (its data, a document, needs it)
_OPERATOR_KINDS = {**_PUBLIC_KINDS, "/metrics": "metrics", status_page.PATH: "document"}
_OPEN_KINDS = frozenset(("livez", "readyz"))  # kubelet probes carry no token
# An address family the host lacks: skip that address unless told to require all.
_FAMILY_MISSING = {errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT}
# Accept errors: one log line per episode, and at most one per this many seconds over episodes.
_ACCEPT_LOG_INTERVAL = 10.0
_BIND_REASONS = {
    errno.EADDRINUSE: "address already in use (another process holds this port)",
    errno.EADDRNOTAVAIL: "address not available on this host",
    errno.EACCES: "permission denied (ports below 1024 need CAP_NET_BIND_SERVICE)",
}


class ListenError(OSError):
    """An address, port or socket a health listener could not bind: a start-up error naming the setting
    (the CLI prints it as one line and exits 2)."""

    def __init__(self, setting: str, address: str, error: OSError | None, *, also: str | None = None) -> None:
        super().__init__(None if error is None else error.errno, None if error is None else error.strerror)
        self.setting = setting
        self.address = address
        self.also = also
        self.reason = ("could bind none of these addresses (this host lacks their families)" if error is None
                       else _BIND_REASONS.get(error.errno or 0, (error.strerror or str(error)).lower()))

    def __str__(self) -> str:
        also = f"; see also {self.also}" if self.also else ""
        return f"{self.setting}: can not listen on {self.address}: {self.reason}{also}"


class HealthListener:
    """Serves the health endpoints of one role on its addresses.

    Lifecycle: :meth:`start` (binds, raises if nothing can be bound), :meth:`stop`; or
    :meth:`run`, which starts, waits until cancelled and stops, for a guarded task.
    """

    def __init__(
        self,
        *,
        region: str,
        source: ViewSource | Callable[[], RegionView | None],
        settings: HealthSettings,
        registry: CollectorRegistry,
        role: Role = Role.PUBLIC,
        port: int | None = None,
        metrics: ListenerMetrics | None = None,
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
        documents: Mapping[str, Document] | None = None,
        handlers: Mapping[str, Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]] | None = None,
    ) -> None:
        """``port`` overrides the role's port setting; ``metrics`` is shared by one process's listeners.

        ``handlers``: path prefix → the handler answering every request under it (operator only).

        ``documents`` adds read-only JSON endpoints (path → :class:`Document`) to an operator
        listener, e.g. the agent's ``/zone``.
        """
        self._region = region_name(region)
        self.role = role
        operator = role is Role.OPERATOR
        if documents and not operator:
            raise ValueError("documents are served by the operator listener only")
        self._operator = operator
        self._fixed_kinds = _OPERATOR_KINDS if operator else _PUBLIC_KINDS
        self._documents = {path: DocumentCache(doc) for path, doc in (documents or {}).items()}
        if handlers and not operator:
            raise ValueError("handlers are served by the operator listener only")
        self._handlers = tuple((handlers or {}).items())
        self._source = as_source(source)
        self._settings = settings
        self._hosts = settings.operator_listen_addresses if operator else settings.listen_addresses
        self._port_override = port
        self._port = port if port is not None else (settings.operator_port if operator else settings.port)
        self._clock = clock or SystemClock()
        self._wall = self._clock.wall
        self._log = logger or logging.getLogger(LOGGER_NAME)
        self._ids = RequestIds(self._region, wall=self._wall)
        self._spans = request_spans(role.value)  # None while tracing is off: one test per request
        metrics = metrics if metrics is not None else ListenerMetrics(registry)
        self._stats, self._conn_stats = metrics.add(role.value)
        self._requests = RequestLog(
            region=self._region,
            per_second=settings.request_log_per_second,
            suppressed=metrics.logs_suppressed,
            logger=self._log,
            monotonic=self._clock.monotonic,
        )
        self._metrics = MetricsCache(registry, max_age=settings.metrics_cache_seconds) if operator else None
        self._token: BearerToken | None = None
        self._accept_log = TokenBucket(1 / _ACCEPT_LOG_INTERVAL, burst=1.0, monotonic=self._clock.monotonic)
        self._accept_failing_since: float | None = None
        self._accept_episode_logged = False
        self._counted: tuple[RegionView | None, CopyCounts] = (None, views.count_copies(None))
        self._started_at = self._wall()
        self._runner: web.ServerRunner | None = None

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("HealthListener.start() called twice; call stop() first")
        if self._operator and self._settings.operator_token_file is not None:
            self._token = BearerToken(self._settings.operator_token_file)  # raises naming the setting
        settings = self._settings
        server = GuardedServer(
            self.handle,
            header_timeout=settings.header_timeout_seconds,
            max_connections=settings.max_connections,
            stats=self._conn_stats,
            error_response=self._error_response,
            access_log=None,
            keepalive_timeout=settings.idle_timeout_seconds,
            lingering_time=0.0,  # GET and HEAD only: never wait for a body nobody reads
            max_headers=64,
        )
        runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=2.0)
        await runner.setup()
        self._runner = runner
        try:
            await self._bind_all(runner)
        except BaseException:
            await self.stop()
            raise
        self._log.info(
            "health listener (%s) listening", self.role.value,
            extra={"region": self._region, "addresses": self.addresses},
        )
        self._warn_if_descriptors_short()

    async def _bind_all(self, runner: web.ServerRunner) -> None:
        skipped: list[str] = []
        settings = self._settings
        for host in self._hosts:
            site = GuardedSite(runner, host, self._port, backlog=1024,
                               on_error=self._accept_failed, on_recovered=self._accept_recovered)
            try:
                await site.start()
            except OSError as exc:
                await site.stop()
                if exc.errno in _FAMILY_MISSING and not settings.require_all_addresses:
                    self._log.warning(
                        "health listener skips %s: %s", host, exc.strerror, extra={"region": self._region}
                    )
                    skipped.append(host)
                    continue
                raise self._listen_error(host, exc) from exc
        if len(skipped) == len(self._hosts):
            raise self._listen_error(" ".join(self._hosts), None)

    def _listen_error(self, host: str, exc: OSError | None) -> ListenError:
        addresses, port = self._setting_names()
        address_problem = exc is None or exc.errno in _FAMILY_MISSING
        setting, also = (addresses, port) if address_problem else (port, addresses)
        return ListenError(setting, f"{host} port {self._port}/tcp", exc, also=also)

    def _setting_names(self) -> tuple[str, str]:
        """The (addresses, port) settings this listener binds, for an error that names them."""
        if not self._operator:
            return "health.listen_addresses", "health.port"
        # Only the sidecar gives an operator listener a port of its own.
        port = "health.operator_port" if self._port_override is None else "health.sidecar_operator_port"
        return "health.operator_listen_addresses", port

    def _warn_if_descriptors_short(self) -> None:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        cap = self._settings.max_connections
        if soft != resource.RLIM_INFINITY and 2 * cap >= soft:
            self._log.warning(
                "health.max_connections (%d per listener) is not well under the descriptor limit (%d): "
                "connections can exhaust descriptors the DNS server and the checks need", cap, soft,
                extra={"region": self._region},
            )

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await asyncio.shield(runner.cleanup())

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every bound socket; ports are real even when configured as 0."""
        if self._runner is None:
            return []
        return [(str(a[0]), int(a[1])) for a in self._runner.addresses]

    @property
    def stats(self) -> RequestStats:
        return self._stats

    # --- accept errors --------------------------------------------------------------------

    def _accept_failed(self, exc: OSError) -> None:
        """Counted every time; logged once per episode (and at most every ten seconds)."""
        name = errno_name(exc)
        conns = self._conn_stats
        conns.accept_errors[name] = conns.accept_errors.get(name, 0) + 1
        conns.accept_paused = True
        if self._accept_failing_since is None:
            self._accept_failing_since = self._clock.monotonic()
            self._accept_episode_logged = self._accept_log.take()
            if self._accept_episode_logged:
                self._log.warning(
                    "health listener (%s) can not accept connections: %s; backing off until it can",
                    self.role.value, exc.strerror or name, extra={"region": self._region, "error": name},
                )

    def _accept_recovered(self) -> None:
        conns = self._conn_stats
        conns.accept_paused = False
        since, self._accept_failing_since = self._accept_failing_since, None
        if since is not None and self._accept_episode_logged:  # the end of an episode whose start was told
            self._log.info(
                "health listener (%s) accepts connections again after %.1f s", self.role.value,
                self._clock.monotonic() - since, extra={"region": self._region},
            )

    # --- requests -------------------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self._handlers:
            for prefix, handler in self._handlers:
                if request.path.startswith(prefix):
                    return await self._delegate(handler, request)
        started = time.perf_counter()
        headers = request.headers
        request_id = self._ids.accept(headers.get("X-Request-Id"))
        path = request.path
        method = request.method
        kind = "global-health" if path.startswith(_GLOBAL) else self._fixed_kinds.get(path, "other")
        if kind == "other" and path in self._documents:
            kind = "document"
        try:
            if method not in _METHODS:
                answer = views.method_not_allowed(region=self._region, request_id=request_id)
            elif (self._token is not None and kind not in _OPEN_KINDS and path != status_page.PATH
                  and not self._token.accepts(headers.get("Authorization"))):
                kind = "unauthorized"
                answer = views.unauthorized(region=self._region, request_id=request_id)
            elif kind == "metrics":
                assert self._metrics is not None  # operator role: built in __init__
                answer = views.metrics(await self._metrics.get(), CONTENT_TYPE_LATEST,
                                       region=self._region, request_id=request_id)
            elif kind == "document" and path == status_page.PATH:
                answer = status_page.page(region=self._region, request_id=request_id)
            elif kind == "document":
                answer = views.document(await self._documents[path].get(), region=self._region,
                                        request_id=request_id)
            else:
                answer = self._answer(kind, path, headers.get("Accept"), request_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log.exception("health listener failed to answer %s", path[:200],
                                extra={"region": self._region, "request_id": request_id})
            answer = views.server_error(region=self._region, request_id=request_id)
        response = web.Response(status=answer.status, body=answer.body, headers=answer.headers)
        seconds = time.perf_counter() - started
        self._stats.observe(kind, answer.status, seconds)
        self._requests.record(
            method=method, path=path, status=answer.status, seconds=seconds, request_id=request_id,
            reason=answer.reason,
        )
        if self._spans is not None:
            self._spans.record(method=method, route=self._route(path), path=path, status=answer.status,
                               request_id=request_id, seconds=seconds, headers=headers)
        return response

    def _route(self, path: str) -> str | None:
        """The span's ``http.route``: a template, so slugs and junk paths do not multiply routes."""
        if path.startswith(_GLOBAL):
            return _GLOBAL + "{slug}"
        return path if path in self._fixed_kinds or path in self._documents else None

    async def _delegate(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                        request: web.BaseRequest) -> web.StreamResponse:
        """A request under a ``handlers`` prefix: answered there, counted and logged here."""
        started = time.perf_counter()
        try:
            response = await handler(request)
            request_id = response.headers.get("X-Request-Id", "")
        except asyncio.CancelledError:
            raise
        except Exception:
            request_id = self._ids.new()
            self._log.exception("health listener: the handler of %s failed", request.path[:200],
                                extra={"region": self._region, "request_id": request_id})
            answer = views.server_error(region=self._region, request_id=request_id)
            response = web.Response(status=answer.status, body=answer.body, headers=answer.headers)
        seconds = time.perf_counter() - started
        self._stats.observe("api", response.status, seconds)
        self._requests.record(method=request.method, path=request.path, status=response.status, seconds=seconds,
                              request_id=request_id, reason="")
        return response

    def _error_response(
        self, request: web.BaseRequest, status: int, exc: BaseException | None, message: str | None
    ) -> web.StreamResponse:
        """aiohttp could not parse the request (400), or a handler failed: same headers as any answer.

        One info line through the request log's rate limit, with the parser's complaint as the
        reason and no traceback: a client's garbage is not the agent's error.
        """
        request_id = self._ids.accept(None)  # nothing of a malformed request is trusted
        answer = views.bad_request(status, region=self._region, request_id=request_id)
        complaint = message or (str(exc) if exc is not None else "")
        reason = " ".join(f"{type(exc).__name__ if exc else 'error'}: {complaint}".split())[:200]
        self._stats.observe("malformed", status, 0.0)
        self._requests.record(method="-", path="-", status=status, seconds=0.0, request_id=request_id,
                              reason=reason)
        if self._spans is not None:
            self._spans.record(method="_OTHER", route=None, path="", status=status, request_id=request_id,
                               seconds=0.0, headers=None)
        return web.Response(status=answer.status, body=answer.body, headers=answer.headers)

    def _answer(self, kind: str, path: str, accept: str | None, request_id: str) -> Answer:
        region = self._region
        if kind == "global-health":
            view, freshness = self._source.current()
            return views.global_health(
                view, path[_GLOBAL_LEN:], region=region, request_id=request_id, freshness=freshness,
                want_json=accept is not None and "application/json" in accept, now=self._wall(),
                verbose=self._operator,
            )
        if kind == "region":
            view, freshness = self._source.current()
            return views.region_health(
                view, region=region, request_id=request_id, freshness=freshness, now=self._wall(),
                lag_threshold_seconds=self._settings.degraded_lag_seconds,
                listener_started_at=self._started_at, counts=self._counts(view), verbose=self._operator,
            )
        if kind == "livez":
            return views.liveness(region=region, request_id=request_id)
        if kind == "readyz":
            view, freshness = self._source.current()
            return views.readiness(view, freshness, region=region, request_id=request_id)
        return views.not_found(region=region, request_id=request_id)

    def _counts(self, view: RegionView | None) -> CopyCounts:
        """Copy counts, computed once per view (views are immutable; identity is the key)."""
        counted_view, counts = self._counted
        if counted_view is not view or view is None:
            counts = views.count_copies(view)
            self._counted = (view, counts)
        return counts
