"""``region-agent run`` as a real process with the OTEL_* environment: its spans reach an OTLP/HTTP receiver.

The receiver (tests/fakes/otlp_receiver.py) decodes the protobuf it gets; the agent is started as
tests/e2e/test_standalone_process.py starts it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from region_agent.demo.fake_copy import HealthEndpoint
from tests.conftest import wait_for
from tests.fakes.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.fakes.ports import free_port

ZONE = """
regions:
  sfo1: {ipv4: [127.0.0.41], ns_ipv4: [127.0.0.1]}
  ams1: {ipv4: [127.0.0.42], ns_ipv4: [127.0.0.1]}
projects:
  shop: {regions: [sfo1, ams1], primary: sfo1}
"""
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def _agent(tmp_path: Path, otel: dict[str, str]) -> AsyncIterator[tuple[subprocess.Popen[bytes], int, int]]:
    """A standalone agent whose environment carries ``otel``; yields (process, public port, operator port)."""
    copies = [HealthEndpoint("127.0.0.41"), HealthEndpoint("127.0.0.42")]
    check_port = await copies[0].start()
    copies[1].port = check_port
    await copies[1].start()
    (tmp_path / "zone.yaml").write_text(ZONE)
    dns_port, http_port, operator_port = free_port(), free_port(), free_port()
    config = tmp_path / "agent.yaml"
    config.write_text(f"""
region: sfo1
zone_file: {tmp_path / "zone.yaml"}
dns: {{zone: g.example.com, listen_addresses: [127.0.0.1], port: {dns_port}}}
checks: {{host: runr-health.g.example.com, port: {check_port}, interval: 0.5, timeout: 0.4}}
health: {{listen_addresses: [127.0.0.1], port: {http_port}, operator_port: {operator_port}}}
""")
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.update(otel)
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "region_agent", "run", "--config", str(config)],
                                   stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        try:
            await wait_for(lambda: _ready(http_port), timeout=20, message="/readyz")
        except AssertionError:
            raise AssertionError(log.read_text()[-3000:]) from None
        yield process, http_port, operator_port
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        for copy in copies:
            await copy.stop()


async def _ready(port: int) -> bool:
    return await _status(port, "/readyz") == 200


async def _status(port: int, path: str, headers: dict[str, str] | None = None) -> int:
    try:
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{port}{path}", headers=headers,
                         timeout=aiohttp.ClientTimeout(total=2)) as response:
            await response.read()
            return response.status
    except aiohttp.ClientError:
        return 0


async def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{port}{path}", headers=headers) as response:
        return response.status, response.headers["X-Request-Id"], await response.text()


def _one(receiver: OtlpReceiver, request_id: str) -> Callable[[], ReceivedSpan | None]:
    def find() -> ReceivedSpan | None:
        spans = receiver.with_attribute("request_id", request_id)
        return spans[0] if spans else None
    return find


async def test_a_running_agent_exports_its_spans(tmp_path: Path) -> None:
    receiver = await OtlpReceiver().start()
    try:
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
                "OTEL_SERVICE_NAME": "region-agent-e2e"}
        async with _agent(tmp_path, otel) as (process, http_port, operator_port):
            traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
            status, request_id, body = await _get(http_port, "/global-health/shop", {"traceparent": traceparent})
            assert (status, body) == (404, "not-found")   # standalone: no copies of its own region to show
            span = await wait_for(_one(receiver, request_id), timeout=10, message="the public span")
            assert span is not None
            assert span.name == "GET /global-health/{slug}"
            assert span.trace_id == TRACE_ID and span.parent_span_id == PARENT_ID
            assert {k: span.attributes[k] for k in ("region", "region_source", "status_code", "http.route")} == {
                "region": "sfo1", "region_source": "agent", "status_code": 404, "http.route": "/global-health/{slug}"}
            assert span.resource["service.name"] == "region-agent-e2e"

            # The control API on the operator listener: no token file, so 401, still a span with its route.
            status, api_id, _ = await _get(operator_port, "/v1/projects/shop")
            assert status == 401
            api_span = await wait_for(_one(receiver, api_id), timeout=10, message="the control API span")
            assert api_span is not None
            assert api_span.attributes["http.route"] == "/v1/projects/{slug}"
            assert api_span.attributes["status_code"] == 401 and api_span.attributes["region"] == "sfo1"

            async with aiohttp.ClientSession() as http, \
                    http.get(f"http://127.0.0.1:{operator_port}/metrics") as response:
                metrics = await response.text()
            assert 'region_agent_tracing_spans_total{outcome="exported"}' in metrics

            # The last spans leave on SIGTERM: the stop flushes them.
            status, last_id, _ = await _get(http_port, "/livez")
            process.send_signal(signal.SIGTERM)
            await wait_for(lambda: process.poll() is not None, timeout=15, message="exit")
            assert process.returncode == 0
            assert _one(receiver, last_id)() is not None, "the span answered just before the stop was flushed"
    finally:
        await receiver.stop()


async def test_a_hung_collector_neither_slows_answers_nor_the_stop(tmp_path: Path) -> None:
    receiver = await OtlpReceiver(mode="hang").start()
    try:
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_MAX_QUEUE_SIZE": "32",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8", "OTEL_BSP_SCHEDULE_DELAY": "50"}
        async with _agent(tmp_path, otel) as (process, http_port, operator_port):
            slowest = 0.0
            async with aiohttp.ClientSession() as http:
                for _ in range(300):
                    started = time.perf_counter()
                    async with http.get(f"http://127.0.0.1:{http_port}/global-health/shop") as response:
                        assert response.status == 404
                        await response.read()
                    slowest = max(slowest, time.perf_counter() - started)
            assert slowest < 0.5, f"an answer took {slowest:.3f} s"
            assert receiver.requests >= 1   # the exporter is stuck in a request the collector never answers

            assert await wait_for(lambda: _dropped_at_least(operator_port, 300 - 32 - 8), timeout=10,
                                  message="drops counted")
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            await wait_for(lambda: process.poll() is not None, timeout=15, message="exit")
            assert process.returncode == 0
            # The tracing flush waits 2 s at most; the rest is the agent's ordinary stop.
            assert time.monotonic() - started < 8
    finally:
        await receiver.stop()


async def _dropped_at_least(operator_port: int, floor: float) -> bool:
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{operator_port}/metrics") as response:
        text = await response.text()
    line = next((x for x in text.splitlines() if x.startswith('region_agent_tracing_spans_total{outcome="dropped"}')),
                "x 0")
    return float(line.rsplit(" ", 1)[1]) >= floor
