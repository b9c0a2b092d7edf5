"""An informer: a cache of one Kubernetes collection kept current by list + watch.

``kubernetes_asyncio.watch.Watch`` is not an informer (PLATFORM.md §2.4: one blind 410 retry,
raw bookmarks, no client timeout), so this module follows client-go's reflector (§2.3) on top of
two plain HTTP calls (:mod:`region_agent.kube.api`):

1. **LIST** in pages of ``page_size`` (``limit``/``continue``). The first list asks for
   ``resourceVersion=0`` (any, cheap from the watch cache); later lists ask for data not older
   than the last resourceVersion seen; after a list was refused with 410 the next one is a
   consistent read (no resourceVersion). An expired ``continue`` token (410 mid-list) restarts the
   list as a consistent read. The result *replaces* the cache: objects that vanished meanwhile
   come out as DELETED with ``final_state_unknown=True``.
2. **WATCH** from the list's resourceVersion with bookmarks and a random server
   ``timeoutSeconds``. Every event and bookmark advances the resourceVersion (always an opaque
   string, never compared). A clean end of stream re-watches without relisting. 410 (as an
   ``ERROR`` event in the stream or as the HTTP status) relists. A connection error or a read
   timeout backs off (full jitter) and re-watches from the last resourceVersion; if that is too
   old by then, the server answers 410 and the informer relists. A watch that ends cleanly within
   ``very_short_watch`` seconds without an event counts as an error, so it cannot spin.
3. The client bounds each watch at ``timeoutSeconds + read_margin`` and each socket read at the
   same, so a half-open TCP connection can not hang the informer.

Objects never stay raw: ``convert`` turns each one into a slim frozen record and only records are
cached. A malformed object or event is logged, counted and skipped; a handler that raises is
logged and counted. Nothing that comes from the apiserver can end :meth:`Informer.run`.

Public API::

    informer = Informer(api=api_client, resource=KNATIVE_SERVICES, convert=KnativeService.from_api,
                        label_selector="region-agent.io/project", settings=WatchSettings(),
                        registry=registry, name="knative-services")
    informer.add_handler(on_event)         # WatchEvent[T] -> None, synchronous, in order, must not block
    informer.add_state_listener(on_state)  # () -> None after each LIST and when the error state changes
    task = create_guarded_task(informer.run(), name="watch knative-services")
    await informer.synced.wait()           # first full LIST is in the cache
    informer.items                         # read-only Mapping "namespace/name" -> record
    informer.error                         # None, or why the last list/watch attempt failed
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import aiohttp
from prometheus_client import CollectorRegistry

from region_agent.base.clock import Backoff, Clock, SystemClock
from region_agent.kube.api import KubeRequests
from region_agent.kube.cache import Cache, EventType, WatchEvent
from region_agent.kube.errors import (
    ApiStatusError,
    KubeError,
    MalformedObjectError,
    ResourceExpiredError,
    StreamError,
)
from region_agent.kube.metrics import InformerMetrics
from region_agent.kube.resources import ResourceRef
from region_agent.kube.settings import WatchSettings

T = TypeVar("T")

logger = logging.getLogger("region_agent.kube.watch")

Handler = Callable[[WatchEvent[T]], None]
StateListener = Callable[[], None]

_OBJECT_EVENTS: frozenset[str] = frozenset({"ADDED", "MODIFIED", "DELETED"})


def object_key(obj: Mapping[str, Any]) -> str:
    """``namespace/name`` (or ``name`` for cluster-scoped objects), as client-go's MetaNamespaceKeyFunc."""
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        raise MalformedObjectError("object without metadata")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedObjectError("object without metadata.name")
    namespace = metadata.get("namespace")
    if isinstance(namespace, str) and namespace:
        return f"{namespace}/{name}"
    return name


def _resource_version(obj: Mapping[str, Any]) -> str | None:
    metadata = obj.get("metadata")
    if isinstance(metadata, Mapping):
        value = metadata.get("resourceVersion")
        if isinstance(value, str) and value:
            return value
    return None


class Informer(Generic[T]):
    """List + watch one collection into a cache of slim records (see the module docstring)."""

    def __init__(
        self,
        *,
        api: Any,
        resource: ResourceRef,
        convert: Callable[[Mapping[str, Any]], T],
        settings: WatchSettings,
        registry: CollectorRegistry,
        label_selector: str | None = None,
        field_selector: str | None = None,
        clock: Clock | None = None,
        name: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.resource = resource
        self.name = name or resource.label
        self._convert = convert
        self._settings = settings
        self._clock: Clock = clock or SystemClock()
        self._rng = rng or random.Random()
        self._requests = KubeRequests(api, connect_timeout=settings.connect_timeout)
        self._selectors: list[tuple[str, str]] = []
        if label_selector:
            self._selectors.append(("labelSelector", label_selector))
        if field_selector:
            self._selectors.append(("fieldSelector", field_selector))
        self._cache: Cache[T] = Cache()
        self._handlers: list[Handler[T]] = []
        self._state_listeners: list[StateListener] = []
        self._backoff = Backoff(
            initial=settings.backoff_initial,
            cap=settings.backoff_cap,
            reset_after=settings.backoff_reset_after,
            rng=self._rng,
        )
        self._metrics = InformerMetrics.for_registry(registry)
        self._metrics.synced.labels(self.name).set(0)
        self._metrics.objects.labels(self.name).set(0)

        self.synced = asyncio.Event()
        """Set once the first full LIST is in the cache; never cleared."""
        self.synced_at: float | None = None
        self.last_event_at: float | None = None
        self.error: str | None = None
        self.resource_version: str | None = None
        self._consistent_list_needed = False

    @property
    def items(self) -> Mapping[str, T]:
        """Read-only view ``key -> record`` of the cache; always current."""
        return self._cache.view

    def add_handler(self, handler: Handler[T]) -> None:
        """Call ``handler`` for every cache change, synchronously on the loop, in order."""
        self._handlers.append(handler)

    def add_state_listener(self, listener: StateListener) -> None:
        """Call ``listener()`` after every full LIST and whenever :attr:`error` changes."""
        self._state_listeners.append(listener)

    async def run(self) -> None:
        """List and watch until cancelled."""
        reason = "initial"
        while True:
            listed_consistently = self._consistent_list_needed
            try:
                await self._list(reason)
            except ResourceExpiredError as error:
                self._record_failure("list-expired", "list", error)
                reason = "list-expired"
                if listed_consistently:  # even a consistent read was refused: not a stale-RV problem
                    await self._sleep_backoff()
                self._consistent_list_needed = True
                continue
            except Exception as error:
                self._record_failure(_failure_reason(error), "list", error)
                reason = "error"
                await self._sleep_backoff()
                continue
            reason = await self._watch_until_expired()

    # -- list ---------------------------------------------------------------------------------

    async def _list(self, reason: str) -> None:
        started = self._clock.monotonic()
        # "0": any version (cheap, from the watch cache); "": a consistent read after a 410.
        version = "" if self._consistent_list_needed else (self.resource_version or "0")
        records: dict[str, T] = {}
        continue_token: str | None = None
        while True:
            params = [*self._selectors, ("limit", str(self._settings.page_size))]
            if continue_token:
                params.append(("continue", continue_token))
            elif version:
                params.append(("resourceVersion", version))
                if version != "0":
                    params.append(("resourceVersionMatch", "NotOlderThan"))
            try:
                page = await self._requests.get_json(self.resource.path, params, timeout=self._settings.list_timeout)
            except ResourceExpiredError:
                if continue_token is None:
                    raise
                logger.info("%s: continue token expired mid-list; restarting as a consistent list", self.name)
                self._metrics.relists.labels(self.name, "continue-expired").inc()
                records, continue_token, version = {}, None, ""
                continue
            continue_token, list_version = self._read_page(page, records)
            if not continue_token:
                break
        if list_version is None:
            raise MalformedObjectError("LIST answer without metadata.resourceVersion")

        changes = self._cache.replace(records)
        self.resource_version = list_version
        self._consistent_list_needed = False
        now = self._clock.wall()
        self._metrics.relists.labels(self.name, reason).inc()
        self._metrics.list_seconds.labels(self.name).observe(self._clock.monotonic() - started)
        self._metrics.objects.labels(self.name).set(len(self._cache))
        self._metrics.last_success.labels(self.name).set(now)
        if not self.synced.is_set():
            self.synced_at = now
            self.synced.set()
            self._metrics.synced.labels(self.name).set(1)
            logger.info("%s: synced %d objects at resourceVersion %s", self.name, len(self._cache), list_version)
        self.error = None
        for change in changes:
            if change.final_state_unknown:
                self._metrics.events.labels(self.name, "SYNTHETIC_DELETED").inc()
            self._emit(change)
        self._notify_state()

    def _read_page(self, page: Mapping[str, Any], records: dict[str, T]) -> tuple[str | None, str | None]:
        items = page.get("items")
        if items is None:
            items = []
        if not isinstance(items, list):
            raise MalformedObjectError("LIST answer whose items is not a list")
        metadata = page.get("metadata")
        if not isinstance(metadata, Mapping):
            metadata = {}
        for obj in items:
            try:
                if not isinstance(obj, Mapping):
                    raise MalformedObjectError("list item is not an object")
                records[object_key(obj)] = self._convert(obj)
            except Exception as error:
                self._skip_malformed("list item", obj, error)
        token = metadata.get("continue")
        version = metadata.get("resourceVersion")
        return (
            token if isinstance(token, str) and token else None,
            version if isinstance(version, str) and version else None,
        )

    # -- watch --------------------------------------------------------------------------------

    async def _watch_until_expired(self) -> str:
        """Watch, re-watching on clean ends and transient errors; return when a relist is needed."""
        while True:
            try:
                await self._watch_once()
            except ResourceExpiredError as error:
                self._record_failure("expired", "watch", error, level=logging.INFO)
                return "expired"
            except Exception as error:
                self._record_failure(_failure_reason(error), "watch", error)
                await self._sleep_backoff()

    async def _watch_once(self) -> None:
        settings = self._settings
        server_timeout = self._rng.randint(settings.server_timeout_min, settings.server_timeout_max)
        deadline = server_timeout + settings.read_margin
        assert self.resource_version is not None
        params = [
            *self._selectors,
            ("watch", "true"),
            ("resourceVersion", self.resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(server_timeout)),
        ]
        started = self._clock.monotonic()
        received = 0
        async with asyncio.timeout(deadline):
            async with self._requests.stream_lines(
                self.resource.path, params, read_timeout=deadline, max_line_bytes=settings.max_line_bytes
            ) as lines:
                async for line in lines:
                    received += 1
                    self._handle_line(line)
        if received == 0 and self._clock.monotonic() - started < settings.very_short_watch:
            raise StreamError("watch ended without a single event right after it started", reason="very-short-watch")
        self._metrics.last_success.labels(self.name).set(self._clock.wall())

    def _handle_line(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError as error:
            self._skip_malformed("watch line", line[:200], error)
            return
        obj = event.get("object") if isinstance(event, dict) else None
        event_type = event.get("type") if isinstance(event, dict) else None
        if not isinstance(obj, dict) or not isinstance(event_type, str):
            self._skip_malformed("watch event", line[:200], MalformedObjectError("no type or object"))
            return
        self._metrics.events.labels(self.name, event_type if event_type in _KNOWN_TYPES else "OTHER").inc()
        if event_type == "ERROR":
            raise ApiStatusError.from_status(obj)
        self._mark_alive()
        version = _resource_version(obj)
        if event_type == "BOOKMARK":
            if version is None:
                self._skip_malformed("bookmark", line[:200], MalformedObjectError("no resourceVersion"))
            else:
                self.resource_version = version
            return
        if event_type not in _OBJECT_EVENTS:
            self._skip_malformed("watch event", line[:200], MalformedObjectError(f"unknown type {event_type!r}"))
            return
        self._apply(event_type, obj)  # type: ignore[arg-type]
        if version is not None:
            self.resource_version = version

    def _apply(self, event_type: EventType, obj: Mapping[str, Any]) -> None:
        try:
            key = object_key(obj)
        except MalformedObjectError as error:
            self._skip_malformed(f"{event_type} event", obj, error)
            return
        try:
            record = self._convert(obj)
        except Exception as error:
            self._skip_malformed(f"{event_type} {key}", obj, error)
            old = self._cache.view.get(key)
            if event_type != "DELETED" or old is None:
                return  # keep the last good record
            record = old
        change = self._cache.apply(event_type, key, record)
        self._metrics.objects.labels(self.name).set(len(self._cache))
        if change is not None:
            self._emit(change)

    # -- bookkeeping --------------------------------------------------------------------------

    def _emit(self, change: WatchEvent[T]) -> None:
        for handler in self._handlers:
            try:
                handler(change)
            except Exception:
                self._metrics.handler_errors.labels(self.name).inc()
                logger.exception("%s: event handler %r failed on %s %s", self.name, handler, change.type, change.key)

    def _notify_state(self) -> None:
        for listener in self._state_listeners:
            try:
                listener()
            except Exception:
                self._metrics.handler_errors.labels(self.name).inc()
                logger.exception("%s: state listener %r failed", self.name, listener)

    def _mark_alive(self) -> None:
        now = self._clock.wall()
        self.last_event_at = now
        self._metrics.last_event.labels(self.name).set(now)
        self._metrics.last_success.labels(self.name).set(now)
        if self.error is not None:
            self.error = None
            self._notify_state()

    def _record_failure(self, reason: str, during: str, error: BaseException, *, level: int = logging.WARNING) -> None:
        self._metrics.watch_errors.labels(self.name, reason).inc()
        description = (
            f"{during} {self.resource.label}: {reason}: {error}"
            if str(error)
            else f"{during} {self.resource.label}: {reason}"
        )
        logger.log(level, "%s: %s", self.name, description, exc_info=error if reason == "unexpected" else None)
        if reason == "expired":
            return  # routine: the relist that follows is the remedy, not a failure to report
        if description != self.error:
            self.error = description
            self._notify_state()

    def _skip_malformed(self, what: str, sample: object, error: BaseException) -> None:
        self._metrics.malformed.labels(self.name).inc()
        logger.warning("%s: skipped malformed %s: %s (%.200r)", self.name, what, error, sample)

    async def _sleep_backoff(self) -> None:
        await asyncio.sleep(self._backoff.next_delay(self._clock.monotonic()))


_KNOWN_TYPES: frozenset[str] = _OBJECT_EVENTS | {"BOOKMARK", "ERROR"}


def _failure_reason(error: BaseException) -> str:
    """A short, bounded label for the errors metric."""
    if isinstance(error, ResourceExpiredError):
        return "expired"
    if isinstance(error, ApiStatusError):
        return f"http-{error.status}"
    if isinstance(error, StreamError):
        return error.reason
    if isinstance(error, MalformedObjectError):
        return "malformed"
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, (aiohttp.ClientError, OSError, KubeError)):
        return "connection"
    return "unexpected"
