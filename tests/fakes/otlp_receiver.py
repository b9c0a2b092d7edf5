"""A fake OTLP/HTTP trace receiver (aiohttp on 127.0.0.1) that decodes what arrives.

``POST /v1/traces`` with an ``application/x-protobuf`` body (gzip or not) is parsed with the
opentelemetry-proto classes (``ExportTraceServiceRequest``) and every span is kept as a
:class:`ReceivedSpan`: plain values (hex ids, attributes as a dict), so tests compare without
touching protobuf. It answers an empty ``ExportTraceServiceResponse`` with 200, or per ``mode``:

==========  =========================================================================
``ok``      decode, keep, 200
``fail``    keep nothing, 503 (the exporter retries, then gives the batch up)
``hang``    keep nothing, never answer (until :meth:`stop`): a collector that accepts and stalls
==========  =========================================================================

Run it in the test's loop (:meth:`start`), or in a thread of its own (:class:`ThreadedReceiver`)
when the test's loop is the one under measurement or a subprocess exports to it.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

PATH = "/v1/traces"


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, which)


def _attributes(pairs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        assert isinstance(pair, KeyValue)
        out[pair.key] = _value(pair.value)
    return out


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str          # 32 hex
    span_id: str           # 16 hex
    parent_span_id: str    # "" for a root span
    kind: int              # opentelemetry.proto.trace.v1.Span.SpanKind: 2 is SERVER
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int       # Status.StatusCode: 0 unset, 1 ok, 2 error
    resource: dict[str, Any]
    scope: str


@dataclass
class OtlpReceiver:
    host: str = "127.0.0.1"
    port: int = 0
    mode: str = "ok"
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0      # POSTs seen, whatever the mode
    content_types: set[str] = field(default_factory=set)
    _runner: web.AppRunner | None = None
    _release: asyncio.Event | None = None

    @property
    def endpoint(self) -> str:
        """The base URL, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes it (the exporter adds ``/v1/traces``)."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> OtlpReceiver:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(PATH, self._handle)
        self._release = asyncio.Event()
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._release is not None:
            self._release.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def named(self, name: str) -> list[ReceivedSpan]:
        return [span for span in list(self.spans) if span.name == name]

    def with_attribute(self, key: str, value: Any) -> list[ReceivedSpan]:
        return [span for span in list(self.spans) if span.attributes.get(key) == value]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.content_types.add(request.content_type)
        if self.mode == "hang":
            assert self._release is not None
            await self._release.wait()
            return web.Response(status=503)
        if self.mode == "fail":
            return web.Response(status=503)
        body = await request.read()
        encoding = request.headers.get("Content-Encoding", "").lower()
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        for resource_spans in message.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(ReceivedSpan(
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), kind=int(span.kind),
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes), status_code=int(span.status.code),
                        resource=resource, scope=scope_spans.scope.name,
                    ))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")


class ThreadedReceiver:
    """An :class:`OtlpReceiver` on its own event loop in a daemon thread (``with ThreadedReceiver() as r``)."""

    def __init__(self, mode: str = "ok") -> None:
        self.receiver = OtlpReceiver(mode=mode)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.receiver.start(), self._loop).result(10)
        return self.receiver

    def __exit__(self, *_exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.receiver.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
