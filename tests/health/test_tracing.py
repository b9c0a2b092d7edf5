"""OpenTelemetry traces of the health listeners and the control API, exported to a fake OTLP/HTTP receiver.

The receiver (tests/fakes/otlp_receiver.py) decodes the protobuf bodies with the opentelemetry-proto
classes, so what is checked is what a collector would get.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from region_agent.base import tracing
from region_agent.base.bearer import BearerToken
from region_agent.base.request_ids import is_valid_request_id
from region_agent.control import PREFIX, ControlAPI
from region_agent.health.listener import HealthListener, Role
from region_agent.health.settings import HealthSettings
from region_agent.state.hlc import HybridClock
from region_agent.state.local import CopyReason
from region_agent.state.store import Store
from tests.fakes.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.fakes.ports import free_port
from tests.health.helpers import REGION, copy, view, wait_until

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
ERROR = 2   # Status.StatusCode.STATUS_CODE_ERROR
OTEL_VARIABLES = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
                  "OTEL_TRACES_SAMPLER", "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_MAX_QUEUE_SIZE",
                  "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_EXPORTER_OTLP_TIMEOUT")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    assert tracing.active() is None, "a test left tracing on"


def _export_to(monkeypatch: pytest.MonkeyPatch, endpoint: str, **more: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")   # ms: spans leave quickly in tests
    for name, value in more.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    fake = await OtlpReceiver().start()
    yield fake
    await fake.stop()


@pytest.fixture
def settings(tmp_path: Path) -> HealthSettings:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return HealthSettings(listen_addresses=("127.0.0.1",), port=0, operator_port=0, operator_token_file=token)


async def _get(url: str, *, method: str = "GET", headers: dict[str, str] | None = None,
               json: object = None) -> tuple[int, str, str]:
    """(status, X-Request-Id, body)."""
    async with aiohttp.ClientSession() as session, \
            session.request(method, url, headers=headers, json=json) as response:
        return response.status, response.headers["X-Request-Id"], await response.text()


def _by_request_id(receiver: OtlpReceiver, request_id: str) -> ReceivedSpan | None:
    found = receiver.with_attribute("request_id", request_id)
    return found[0] if found else None


async def _span(receiver: OtlpReceiver, request_id: str) -> ReceivedSpan:
    await wait_until(lambda: _by_request_id(receiver, request_id) is not None, timeout=10,
                     message=f"the span of {request_id}")
    span = _by_request_id(receiver, request_id)
    assert span is not None
    assert len(receiver.with_attribute("request_id", request_id)) == 1, "one span per request"
    return span


# --- on or off ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("environ", "on"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),             # the SDK's default endpoint, asked for explicitly
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
    ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, False),
    ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_TRACES_EXPORTER": "otlp"}, True),
])
def test_the_environment_turns_tracing_on(environ: dict[str, str], on: bool) -> None:
    assert tracing.wanted(environ)[0] is on


def _otel_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("OtelBatch")]


async def test_without_the_environment_nothing_is_built_or_exported(
        monkeypatch: pytest.MonkeyPatch, settings: HealthSettings, receiver: OtlpReceiver) -> None:
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    built: list[object] = []
    real_init = trace_exporter.OTLPSpanExporter.__init__

    def counting_init(self: trace_exporter.OTLPSpanExporter, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(trace_exporter.OTLPSpanExporter, "__init__", counting_init)
    threads_before = _otel_threads()
    registry = CollectorRegistry()
    assert tracing.start_from_env(region=REGION, node="n1", version="t", registry=registry) is None
    listener = HealthListener(region=REGION, source=lambda: view([copy("shop")]), settings=settings,
                              registry=registry)
    assert listener._spans is None
    await listener.start()
    try:
        host, port = listener.addresses[0]
        for _ in range(20):
            status, _rid, _body = await _get(f"http://{host}:{port}/global-health/shop",
                                             headers={"traceparent": TRACEPARENT})
            assert status == 200
    finally:
        await listener.stop()
    assert built == [] and tracing.active() is None
    assert _otel_threads() == threads_before
    assert registry.get_sample_value("region_agent_tracing_spans_total", {"outcome": "exported"}) is None
    assert receiver.requests == 0


# --- spans of the public listener -------------------------------------------------------------


async def test_public_listener_spans_carry_the_attributes(
        monkeypatch: pytest.MonkeyPatch, settings: HealthSettings, receiver: OtlpReceiver) -> None:
    _export_to(monkeypatch, receiver.endpoint, OTEL_SERVICE_NAME="agent-under-test")
    registry = CollectorRegistry()
    traces = tracing.start_from_env(region=REGION, node="n1", version="9.9", registry=registry)
    assert traces is not None
    current = view([copy("shop"), copy("cart", CopyReason.NO_READY_REVISION)])
    listener = HealthListener(region=REGION, source=lambda: current, settings=settings, registry=registry)
    await listener.start()
    try:
        host, port = listener.addresses[0]
        base = f"http://{host}:{port}"
        given = "req_ams1-1800000000123-0a1b2c3d4e5f"
        ok = await _get(f"{base}/global-health/shop", headers={"X-Request-Id": given, "traceparent": TRACEPARENT})
        assert ok[:2] == (200, given)
        unhealthy = await _get(f"{base}/global-health/cart")
        missing = await _get(f"{base}/global-health/nope")
        region = await _get(f"{base}/health/region")
        livez = await _get(f"{base}/livez")
        junk = await _get(f"{base}/wp-admin/../etc/passwd")
        post = await _get(f"{base}/livez", method="POST")
        assert [r[0] for r in (unhealthy, missing, region, livez, junk, post)] == [503, 404, 200, 200, 404, 405]

        span = await _span(receiver, given)
        assert span.name == "GET /global-health/{slug}" and span.kind == SERVER
        attributes = span.attributes
        assert attributes["region"] == REGION and attributes["region_source"] == "agent"
        assert attributes["status_code"] == 200 and attributes["http.response.status_code"] == 200
        assert attributes["http.request.method"] == "GET"
        assert attributes["http.route"] == "/global-health/{slug}"
        assert attributes["url.path"] == "/global-health/shop"
        assert attributes["listener"] == "public"
        assert 0 <= attributes["latency_ms"] < 1000
        assert "org_id" not in attributes  # monitors and DNS servers have no org
        # The caller's trace goes on: same trace id, the caller's span as the parent.
        assert span.trace_id == TRACE_ID and span.parent_span_id == PARENT_ID
        assert span.end_ns >= span.start_ns
        assert span.resource["service.name"] == "agent-under-test"
        assert span.resource["service.version"] == "9.9" and span.resource["service.instance.id"] == "n1"

        for (status, request_id, _body), name, route in (
                (unhealthy, "GET /global-health/{slug}", "/global-health/{slug}"),
                (missing, "GET /global-health/{slug}", "/global-health/{slug}"),
                (region, "GET /health/region", "/health/region"),
                (livez, "GET /livez", "/livez"),
                (junk, "GET", None),            # no route: the span name stays bounded
                (post, "POST /livez", "/livez")):
            assert is_valid_request_id(request_id)
            got = await _span(receiver, request_id)
            assert (got.name, got.attributes.get("http.route"), got.attributes["status_code"]) == (name, route, status)
            assert got.parent_span_id == "" and got.trace_id != TRACE_ID  # no traceparent: a new trace
            assert got.status_code == 0  # 4xx, and 503 verdicts, are not server errors
        await wait_until(lambda: (registry.get_sample_value("region_agent_tracing_spans_total",
                                                            {"outcome": "exported"}) or 0) >= 7, timeout=5,
                         message="exported spans counted")
        assert receiver.content_types == {"application/x-protobuf"}
    finally:
        await listener.stop()
        assert await traces.shutdown()


async def test_a_parser_refusal_and_a_failing_answer_are_spans_too(
        monkeypatch: pytest.MonkeyPatch, settings: HealthSettings, receiver: OtlpReceiver) -> None:
    import asyncio

    _export_to(monkeypatch, receiver.endpoint)
    traces = tracing.start_from_env(region=REGION, node="n1", version="t")
    assert traces is not None

    def broken() -> None:
        raise RuntimeError("the view exploded")

    listener = HealthListener(region=REGION, source=broken, settings=settings, registry=CollectorRegistry())
    await listener.start()
    try:
        host, port = listener.addresses[0]
        status, request_id, _ = await _get(f"http://{host}:{port}/global-health/shop")
        assert status == 500
        span = await _span(receiver, request_id)
        assert span.attributes["error.type"] == "500" and span.status_code == ERROR

        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Name: 1\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.split(b" ", 2)[1] == b"400"
        refused_id = next(line.split(b": ", 1)[1].decode() for line in answer.split(b"\r\n")
                          if line.lower().startswith(b"x-request-id:"))
        refused = await _span(receiver, refused_id)
        assert refused.attributes["status_code"] == 400 and refused.attributes["http.request.method"] == "_OTHER"
        assert "http.route" not in refused.attributes and "url.path" not in refused.attributes
    finally:
        await listener.stop()
        await traces.shutdown()


# --- spans of the control API ------------------------------------------------------------------


async def test_control_api_spans_carry_route_org_and_request_id(
        monkeypatch: pytest.MonkeyPatch, settings: HealthSettings, receiver: OtlpReceiver) -> None:
    _export_to(monkeypatch, receiver.endpoint)
    traces = tracing.start_from_env(region=REGION, node="n1", version="t")
    assert traces is not None
    ms = iter(range(1_800_000_000_000, 1_900_000_000_000, 1000))
    assert settings.operator_token_file is not None
    api = ControlAPI(store=Store(writer="sfo1/n1", clock=HybridClock(lambda: next(ms))), node="n1", region=REGION,
                     members=list, has_majority=lambda: True, digests=dict,
                     token=BearerToken(settings.operator_token_file))
    listener = HealthListener(region=REGION, source=lambda: None, settings=settings, registry=CollectorRegistry(),
                              role=Role.OPERATOR, handlers={PREFIX: api.handle})
    await listener.start()
    try:
        host, port = listener.addresses[0]
        base = f"http://{host}:{port}"
        region = {"ipv4": ["192.0.2.1"], "latitude": 37.6, "longitude": -122.4}
        put = await _get(f"{base}/v1/regions/sfo1", method="PUT", json=region,
                         headers={**AUTH, "X-Org-Id": "org_42", "traceparent": TRACEPARENT})
        refused = await _get(f"{base}/v1/regions/sfo1", method="PUT", json=region, headers={"X-Org-Id": "org_42"})
        missing = await _get(f"{base}/v1/projects/nope", headers={**AUTH, "X-Org-Id": "bad org; id"})
        unknown = await _get(f"{base}/v1/nothing-here", headers=AUTH)
        metrics = await _get(f"{base}/metrics", headers=AUTH)   # the operator listener's own path
        assert [r[0] for r in (put, refused, missing, unknown, metrics)] == [201, 401, 404, 404, 200]

        span = await _span(receiver, put[1])
        assert span.name == "PUT /v1/regions/{name}" and span.kind == SERVER
        assert span.attributes["http.route"] == "/v1/regions/{name}"
        assert span.attributes["url.path"] == "/v1/regions/sfo1"
        assert span.attributes["status_code"] == 201 and span.attributes["org_id"] == "org_42"
        assert span.attributes["region"] == REGION and span.attributes["region_source"] == "agent"
        assert span.attributes["listener"] == "control"
        assert span.trace_id == TRACE_ID and span.parent_span_id == PARENT_ID

        no_token = await _span(receiver, refused[1])
        assert no_token.attributes["status_code"] == 401 and "org_id" not in no_token.attributes
        not_found = await _span(receiver, missing[1])
        assert not_found.attributes["http.route"] == "/v1/projects/{slug}" and "org_id" not in not_found.attributes
        nowhere = await _span(receiver, unknown[1])
        assert nowhere.name == "GET" and "http.route" not in nowhere.attributes
        scrape = await _span(receiver, metrics[1])
        assert scrape.name == "GET /metrics" and scrape.attributes["listener"] == "operator"
        # A request to the API is one span (the API's), not one per layer.
        assert len([s for s in receiver.spans if s.attributes.get("url.path") == "/v1/regions/sfo1"]) == 2
    finally:
        await listener.stop()
        await traces.shutdown()


# --- a collector that is down ------------------------------------------------------------------


@pytest.mark.parametrize("collector", ["hangs", "refuses"])
async def test_a_dead_collector_does_not_slow_answers(
        monkeypatch: pytest.MonkeyPatch, settings: HealthSettings, collector: str) -> None:
    hanging = OtlpReceiver(mode="hang")
    if collector == "hangs":
        await hanging.start()
        endpoint = hanging.endpoint
    else:
        endpoint = f"http://127.0.0.1:{free_port()}"   # nothing listens: connections refused
    _export_to(monkeypatch, endpoint, OTEL_BSP_MAX_QUEUE_SIZE="64", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="16",
               OTEL_EXPORTER_OTLP_TIMEOUT="1")
    registry = CollectorRegistry()
    traces = tracing.start_from_env(region=REGION, node="n1", version="t", registry=registry)
    assert traces is not None
    listener = HealthListener(region=REGION, source=lambda: view([copy("shop")]), settings=settings,
                              registry=registry)
    await listener.start()
    try:
        host, port = listener.addresses[0]
        url = f"http://{host}:{port}/global-health/shop"
        slowest = 0.0
        async with aiohttp.ClientSession() as session:
            for _ in range(400):
                started = time.perf_counter()
                async with session.get(url) as response:
                    assert response.status == 200
                    await response.read()
                slowest = max(slowest, time.perf_counter() - started)
        # The export thread is stuck (or failing) the whole time; answers never wait for it.
        assert slowest < 0.5, f"an answer took {slowest:.3f} s while the collector {collector}"

        def outcome(name: str) -> float:
            return registry.get_sample_value("region_agent_tracing_spans_total", {"outcome": name}) or 0

        # 400 spans into a queue of 64 that nothing drains (hangs) or drains only into failures (refuses).
        await wait_until(lambda: outcome("dropped") + outcome("failed") >= 400 - 64, timeout=15,
                         message="lost spans counted")
        assert outcome("exported") == 0
        assert registry.get_sample_value("region_agent_tracing_queue_spans") is not None
        # A stop waits for the stuck exporter a bounded time only.
        started = time.perf_counter()
        await traces.shutdown(timeout=1.0)
        assert time.perf_counter() - started < 2.0
    finally:
        await listener.stop()
        await traces.shutdown()
        await hanging.stop()
