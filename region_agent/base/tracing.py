"""OpenTelemetry traces of the HTTP requests the agent answers: one server span per request, exported by OTLP/HTTP.

Off unless the standard ``OTEL_*`` environment turns it on (:func:`wanted`), and then off the
answer path as far as Python allows:

- **on/off.** ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` is off; ``OTEL_TRACES_EXPORTER=otlp``
  is on; unset, tracing is on only when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the SDK's own default would export to
  ``localhost:4318`` whether or not a collector is there). Only ``http/protobuf`` is offered: another
  ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` or exporter leaves tracing off with a warning. Everything
  else the SDK reads itself: endpoint, headers, timeout, compression, certificates, ``OTEL_BSP_*``,
  ``OTEL_TRACES_SAMPLER`` (default ``parentbased_always_on``), ``OTEL_SERVICE_NAME`` (default
  ``region-agent``), ``OTEL_RESOURCE_ATTRIBUTES``.
- **off costs one attribute test per request**: the listeners ask :func:`request_spans` once, when
  built; with tracing off they hold ``None`` and never reach this module again. No provider, no
  processor, no exporter and no thread exist.
- **on, nothing blocks the loop**: a span is made *after* the answer, from the times already
  measured (:meth:`RequestSpans.record`), and handed to a ``BatchSpanProcessor``, a bounded queue
  (``OTEL_BSP_MAX_QUEUE_SIZE``, 2048) that the exporter's own thread drains. A dead or slow collector
  fills the queue; further spans are dropped (counted, not logged one by one: the SDK would log a
  warning per dropped span) and answers do not wait. :meth:`Tracing.shutdown` flushes for a bounded
  time from a daemon thread, so a dead collector can not hold up a stop.
- **propagation**: an incoming W3C ``traceparent`` (and ``tracestate``) makes the span a child of the
  caller's, so a caller's trace continues through the agent.

Span attributes (NFR-19 of the routing conventions): ``region`` (the agent's region), ``region_source``
(where that value came from: ``agent``, the agent's configured ``region`` setting, the only source
today), ``request_id`` (the ``X-Request-Id`` answered), ``org_id`` (only where known: see the control
API), ``latency_ms``, ``status_code``; and the HTTP semantic conventions: ``http.request.method``
(``_OTHER`` for unknown methods), ``http.route`` (a template: bounded cardinality; absent for paths
no route matches), ``url.path`` (at most 256 characters), ``url.scheme``, ``http.response.status_code``,
``error.type`` and the span status ERROR for a 5xx other than 503 (a 503 is an answer here: a copy unhealthy,
not ready, no write majority). The span is named ``{method} {route}`` (``{method}`` alone without a route).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence, Sized
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["RequestSpans", "Tracing", "active", "request_spans", "start_from_env", "wanted"]

logger = logging.getLogger("region_agent.tracing")

SERVICE_NAME = "region-agent"
REGION_SOURCE_AGENT = "agent"   # the region attribute is the agent's configured region
SHUTDOWN_SECONDS = 2.0          # the most a stop waits for the last spans to leave
_PATH_LIMIT = 256
_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE"))
_TRUE = ("true", "1", "yes")

_active: Tracing | None = None


def wanted(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether ``environ`` asks for traces, and why (for one log line)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False, "OTEL_SDK_DISABLED"
    exporters = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    endpoint = (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())
    if exporters:
        if "otlp" not in exporters:
            return False, f"OTEL_TRACES_EXPORTER={','.join(exporters)} (only otlp is offered)"
    elif not endpoint:
        return False, "no OTLP endpoint configured"
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or "http/protobuf")
    if protocol != "http/protobuf":
        return False, f"OTLP protocol {protocol} (only http/protobuf is offered)"
    return True, "otlp"


def active() -> Tracing | None:
    """The process's tracing, once :func:`start_from_env` turned it on."""
    return _active


def request_spans(listener: str) -> RequestSpans | None:
    """What a listener records its requests with, or ``None`` while tracing is off (ask once, when built)."""
    tracing = _active
    return None if tracing is None else tracing.spans(listener)


def start_from_env(*, region: str, node: str, version: str, registry: CollectorRegistry | None = None,
                   environ: Mapping[str, str] | None = None) -> Tracing | None:
    """Turn tracing on for this process when the environment asks for it (else ``None``, nothing built)."""
    global _active
    env = os.environ if environ is None else environ
    on, why = wanted(env)
    if not on:
        level = logging.WARNING if why.startswith(("OTEL_TRACES_EXPORTER", "OTLP protocol")) else logging.DEBUG
        logger.log(level, "tracing off: %s", why, extra={"region": region})
        return None
    tracing = Tracing(region=region, node=node, version=version, registry=registry)
    _active = tracing
    logger.info("tracing on: spans exported by OTLP/HTTP to %s", tracing.endpoint, extra={"region": region})
    return tracing


class _Counts:
    """What happened to finished spans; written by the loop and the exporter's thread (ints: GIL-atomic enough)."""

    __slots__ = ("dropped", "exported", "failed")

    def __init__(self) -> None:
        self.dropped = 0    # queue full: never queued
        self.failed = 0     # queued, but the export failed (after the exporter's retries)
        self.exported = 0


def _counting_exporter(inner: SpanExporter, counts: _Counts) -> SpanExporter:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class CountingExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            batch = list(spans)
            result = inner.export(batch)
            if result is SpanExportResult.SUCCESS:
                counts.exported += len(batch)
            else:
                counts.failed += len(batch)
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    return CountingExporter()


def _processor(exporter: SpanExporter, counts: _Counts) -> SpanProcessor:
    """A ``BatchSpanProcessor`` that drops, and counts, a span finding the queue full instead of logging it."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class BoundedBatchSpanProcessor(BatchSpanProcessor):
        def __init__(self) -> None:
            super().__init__(exporter)
            inner = getattr(self, "_batch_processor", None)
            queue, size = getattr(inner, "_queue", None), getattr(inner, "_max_queue_size", None)
            # The SDK's internals (1.34+); without them the SDK drops on its own and logs each drop.
            self._bounded = (queue, size) if queue is not None and isinstance(size, int) else None

        def on_end(self, span: ReadableSpan) -> None:
            bounded = self._bounded
            if bounded is not None and len(bounded[0]) >= bounded[1]:
                if span.context is not None and span.context.trace_flags.sampled:
                    counts.dropped += 1
                return
            super().on_end(span)

    return BoundedBatchSpanProcessor()


class Tracing:
    """An SDK tracer provider exporting by OTLP/HTTP through a bounded batch processor (its own thread)."""

    def __init__(self, *, region: str, node: str, version: str, registry: CollectorRegistry | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.region = region
        detected = OTELResourceDetector().detect()   # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES win
        resource = Resource.create({
            "service.name": SERVICE_NAME, "service.version": version, "service.instance.id": node,
            "region": region, **dict(detected.attributes),
        })
        self.counts = _Counts()
        exporter = OTLPSpanExporter()   # endpoint, headers, timeout, TLS from OTEL_EXPORTER_OTLP_*
        self.endpoint = _shown_endpoint(str(getattr(exporter, "_endpoint", "?")))
        processor = _processor(_counting_exporter(exporter, self.counts), self.counts)
        # shutdown_on_exit off: the SDK's atexit flush could wait for a dead collector for its whole timeout.
        self.provider: TracerProvider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.provider.add_span_processor(processor)
        self._tracer: Tracer = self.provider.get_tracer("region_agent", version)
        self._propagator = TraceContextTextMapPropagator()
        self._bounded: tuple[Sized, int] | None = getattr(processor, "_bounded", None)
        self._collector: _TracingCollector | None = None
        if registry is not None:
            self._collector = _TracingCollector(self)
            registry.register(self._collector)
        self._registry = registry
        self._closed = False

    def spans(self, listener: str) -> RequestSpans:
        return RequestSpans(self._tracer, self._propagator, region=self.region, listener=listener)

    def queued(self) -> int:
        bounded = self._bounded
        return 0 if bounded is None else len(bounded[0])

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        """Export what is queued now (blocking: tests, or a worker thread)."""
        return self.provider.force_flush(int(timeout_seconds * 1000))

    async def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> bool:
        """Flush and stop the exporter, waiting at most ``timeout`` (in a daemon thread: a hung export stays
        behind and dies with the process). True when it finished in time."""
        global _active
        if _active is self:
            _active = None
        if self._closed:
            return True
        self._closed = True
        if self._collector is not None and self._registry is not None:
            with contextlib.suppress(KeyError):
                self._registry.unregister(self._collector)
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def run() -> None:
            try:
                self.provider.shutdown()
            except Exception:
                logger.exception("tracing: shutdown failed")
            finally:
                with contextlib.suppress(RuntimeError):   # the loop may be gone already
                    loop.call_soon_threadsafe(done.set)

        threading.Thread(target=run, name="otel-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except TimeoutError:
            logger.warning("tracing: the last spans did not leave within %.1f s (collector down?); dropped",
                           timeout, extra={"region": self.region})
            return False
        return True


def _shown_endpoint(url: str) -> str:
    """The endpoint for a log line, without any user:password."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


class RequestSpans:
    """Records one server span per answered request of one listener (``public``, ``operator``, ``control``)."""

    __slots__ = ("_error", "_kind", "_listener", "_propagator", "_region", "_tracer")

    def __init__(self, tracer: Tracer, propagator: TraceContextTextMapPropagator, *, region: str,
                 listener: str) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._tracer = tracer
        self._propagator = propagator
        self._region = region
        self._listener = listener
        self._kind = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)

    def record(self, *, method: str, route: str | None, path: str, status: int | None, request_id: str | None,
               seconds: float, headers: Mapping[str, str] | None, org_id: str | None = None,
               error: str | None = None) -> None:
        """A span from ``seconds`` ago until now; ``status`` None when no answer was sent (``error`` says why)."""
        end = time.time_ns()
        start = end - int(seconds * 1e9)
        context = None
        if headers is not None and "traceparent" in headers:
            context = self._propagator.extract(headers)
        known = method if method in _METHODS else "_OTHER"
        shown = known if known != "_OTHER" else "HTTP"
        attributes: dict[str, str | int | float] = {
            "region": self._region,
            "region_source": REGION_SOURCE_AGENT,
            "latency_ms": round(seconds * 1000, 3),
            "http.request.method": known,
            "url.scheme": "http",
            "listener": self._listener,
        }
        if known == "_OTHER" and method:
            attributes["http.request.method_original"] = method[:32]
        if path:
            attributes["url.path"] = path[:_PATH_LIMIT]
        if route is not None:
            attributes["http.route"] = route
        if request_id:
            attributes["request_id"] = request_id
        if org_id:
            attributes["org_id"] = org_id
        if status is not None:
            attributes["status_code"] = status
            attributes["http.response.status_code"] = status
        # A 503 is a verdict (a copy unhealthy, not ready, no majority for writes), not the server failing.
        failed = error is not None or (status is not None and status >= 500 and status != 503)
        if failed:
            attributes["error.type"] = error or str(status)
        span = self._tracer.start_span(f"{shown} {route}" if route else shown, context=context, kind=self._kind,
                                       attributes=attributes, start_time=start, record_exception=False,
                                       set_status_on_exception=False)
        if failed:
            span.set_status(self._error)
        span.end(end_time=end)


class _TracingCollector(Collector):
    def __init__(self, tracing: Tracing) -> None:
        self._tracing = tracing

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        counts = self._tracing.counts
        spans = CounterMetricFamily("region_agent_tracing_spans", "Finished spans by what became of them: "
                                    "exported, dropped (the queue was full), failed (the export failed)",
                                    labels=["outcome"])
        spans.add_metric(["exported"], counts.exported)
        spans.add_metric(["dropped"], counts.dropped)
        spans.add_metric(["failed"], counts.failed)
        yield spans
        yield GaugeMetricFamily("region_agent_tracing_queue_spans", "Spans waiting in the export queue",
                                value=self._tracing.queued())
