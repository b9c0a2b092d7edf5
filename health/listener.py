"""The health listener: aiohttp on port 8086, answering from a :class:`ViewSource`.

This is a hot path (DNS servers and monitors of every region poll it), so it is built on
aiohttp's low-level ``web.Server`` + ``ServerRunner`` instead of an ``Application``: one
handler dispatching on a handful of fixed paths skips the router, middlewares and signals
(measured here: ~36k vs ~31k requests/s for a bare handler under ``wrk -t1 -c50``). The
answers come from :mod:`health.views` (pure); per request the listener only reads the
source, validates or makes a request id, builds a small header dict and counts into plain
ints (:mod:`health.metrics`). aiohttp's access log is off; :mod:`health.access_log` decides
what to log. Catch-all dispatch also means a 404 or 405 carries ``X-Region`` and
``X-Request-Id`` like every other answer.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from agent.base.clock import Clock, SystemClock
from agent.base.names import region_name
from agent.state.local import RegionView
from health import views
from health.access_log import LOGGER_NAME, RequestLog
from health.metrics import RequestStats, ViewCollector
from health.request_ids import RequestIds
from health.settings import HealthSettings
from health.source import ViewSource, as_source
from health.views import Answer, CopyCounts, Freshness

__all__ = ["HealthListener"]

_METHODS = frozenset(("GET", "HEAD"))
_GLOBAL = "/global-health/"
_GLOBAL_LEN = len(_GLOBAL)
_FIXED_KINDS = {"/health/region": "region", "/livez": "livez", "/readyz": "readyz", "/metrics": "metrics"}
# An address family the host lacks: skip that address unless told to require all.
_FAMILY_MISSING = {errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT}


class HealthListener:
    """Serves the health endpoints on the configured addresses.

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
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
        documents: Mapping[str, Callable[[], object]] | None = None,
    ) -> None:
        """``documents`` adds read-only JSON endpoints (path → provider), e.g. the agent's ``/zone``."""
        self._region = region_name(region)
        self._documents = dict(documents or {})
        self._source = as_source(source)
        self._settings = settings
        self._registry = registry
        self._clock = clock or SystemClock()
        self._wall = self._clock.wall
        self._log = logger or logging.getLogger(LOGGER_NAME)
        self._ids = RequestIds(self._region, wall=self._wall)
        self._stats = RequestStats()
        self._requests = RequestLog(
            region=self._region,
            per_second=settings.request_log_per_second,
            registry=registry,
            logger=self._log,
            monotonic=self._clock.monotonic,
        )
        self._counted: tuple[RegionView | None, CopyCounts] = (None, views.count_copies(None))
        registry.register(self._stats)
        registry.register(ViewCollector(self._scrape_snapshot))
        self._started_at = self._wall()
        self._runner: web.ServerRunner | None = None

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("HealthListener.start() called twice; call stop() first")
        server = web.Server(self.handle, access_log=None)
        runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=2.0)
        await runner.setup()
        self._runner = runner
        try:
            await self._bind_all(runner)
        except BaseException:
            await self.stop()
            raise
        self._log.info(
            "health listener listening", extra={"region": self._region, "addresses": self.addresses}
        )

    async def _bind_all(self, runner: web.ServerRunner) -> None:
        skipped: list[str] = []
        for host in self._settings.listen_addresses:
            site = web.TCPSite(runner, host, self._settings.port, backlog=1024)
            try:
                await site.start()
            except OSError as exc:
                await site.stop()
                if exc.errno in _FAMILY_MISSING and not self._settings.require_all_addresses:
                    self._log.warning(
                        "health listener skips %s: %s", host, exc.strerror, extra={"region": self._region}
                    )
                    skipped.append(host)
                    continue
                raise OSError(
                    exc.errno,
                    f"health listener can not listen on [{host}]:{self._settings.port}: {exc.strerror} "
                    "(settings health.listen_addresses, health.port)",
                ) from exc
        if len(skipped) == len(self._settings.listen_addresses):
            raise OSError(f"health listener could bind none of {list(self._settings.listen_addresses)} "
                          "(setting health.listen_addresses)")

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await asyncio.shield(runner.cleanup())

    async def run(self) -> None:
        """Start, serve until cancelled, then stop (for ``create_guarded_task``)."""
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every bound socket; ports are real even when configured as 0."""
        if self._runner is None:
            return []
        return [(str(a[0]), int(a[1])) for a in self._runner.addresses]

    @property
    def stats(self) -> RequestStats:
        return self._stats

    # --- requests -------------------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        started = time.perf_counter()
        headers = request.headers
        request_id = self._ids.accept(headers.get("X-Request-Id"))
        path = request.path
        method = request.method
        kind = "global-health" if path.startswith(_GLOBAL) else _FIXED_KINDS.get(path, "other")
        if kind == "other" and path in self._documents:
            kind = "document"
        try:
            if method not in _METHODS:
                answer = views.method_not_allowed(region=self._region, request_id=request_id)
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
        return response

    def _answer(self, kind: str, path: str, accept: str | None, request_id: str) -> Answer:
        region = self._region
        if kind == "global-health":
            view, freshness = self._source.current()
            return views.global_health(
                view, path[_GLOBAL_LEN:], region=region, request_id=request_id, freshness=freshness,
                want_json=accept is not None and "application/json" in accept, now=self._wall(),
            )
        if kind == "region":
            view, freshness = self._source.current()
            return views.region_health(
                view, region=region, request_id=request_id, freshness=freshness, now=self._wall(),
                lag_threshold_seconds=self._settings.degraded_lag_seconds,
                listener_started_at=self._started_at, counts=self._counts(view),
            )
        if kind == "livez":
            return views.liveness(region=region, request_id=request_id)
        if kind == "readyz":
            view, freshness = self._source.current()
            return views.readiness(view, freshness, region=region, request_id=request_id)
        if kind == "metrics":
            return views.metrics(generate_latest(self._registry), CONTENT_TYPE_LATEST,
                                 region=region, request_id=request_id)
        if kind == "document":
            return views.document(self._documents[path](), region=region, request_id=request_id)
        return views.not_found(region=region, request_id=request_id)

    def _counts(self, view: RegionView | None) -> CopyCounts:
        """Copy counts, computed once per view (views are immutable; identity is the key)."""
        counted_view, counts = self._counted
        if counted_view is not view or view is None:
            counts = views.count_copies(view)
            self._counted = (view, counts)
        return counts

    def _scrape_snapshot(self) -> tuple[RegionView | None, Freshness, CopyCounts]:
        view, freshness = self._source.current()
        return view, freshness, self._counts(view)
