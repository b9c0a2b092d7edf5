"""The listener under hostile clients, over raw sockets: slowloris, idle connections, the cap, garbage.

Every wait is a condition with a deadline; the timeouts are shortened through the settings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry

from region_agent.base.clock import ManualClock
from region_agent.base.logs import JsonFormatter
from region_agent.base.request_ids import is_valid_request_id
from region_agent.health.access_log import LOGGER_NAME
from region_agent.health.listener import HealthListener
from region_agent.health.settings import HealthSettings
from region_agent.health.source import ViewHolder
from tests.health.helpers import REGION, copy, view, wait_until

SETTINGS = HealthSettings(listen_addresses=("127.0.0.1",), port=0, header_timeout_seconds=0.5,
                          idle_timeout_seconds=30.0)
Start = Callable[..., Awaitable[tuple[HealthListener, int]]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    started: list[HealthListener] = []

    async def make(settings: HealthSettings = SETTINGS, *, registry: CollectorRegistry | None = None,
                   clock: ManualClock | None = None) -> tuple[HealthListener, int]:
        listener = HealthListener(region=REGION, source=ViewHolder(view([copy("shop")])), settings=settings,
                                  registry=registry or CollectorRegistry(), clock=clock)
        await listener.start()
        started.append(listener)
        return listener, listener.addresses[0][1]

    yield make
    for listener in started:
        await listener.stop()


async def closed_by_server(reader: asyncio.StreamReader, timeout: float = 5.0) -> bool:
    """True once the server closed the connection (EOF or reset), False if it is still open."""
    try:
        while await asyncio.wait_for(reader.read(65536), timeout):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


async def test_a_client_sending_headers_a_byte_at_a_time_is_closed(start: Start) -> None:
    listener, port = await start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = b"GET /global-health/shop HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 10_000
    closed = asyncio.ensure_future(closed_by_server(reader, timeout=10))
    began = time.monotonic()
    try:
        for byte in request:  # bounded: the request is finite, and the deadline is far shorter
            if closed.done():
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(0.01)
        assert await closed, "the trickling client was never closed"
    finally:
        writer.close()
    assert time.monotonic() - began >= SETTINGS.header_timeout_seconds
    assert listener._conn_stats.closed["header-timeout"] == 1


async def test_a_complete_request_in_time_is_answered_and_the_deadline_starts_again(start: Start) -> None:
    listener, port = await start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(3):  # keep-alive: every request gets its own deadline
            writer.write(b"GET /global-health/shop HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), 5)
            assert head.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
    assert listener._conn_stats.closed["header-timeout"] == 0


async def test_idle_connections_are_closed_after_the_idle_timeout(start: Start) -> None:
    listener, port = await start(SETTINGS.model_copy(update={"idle_timeout_seconds": 0.3}))
    silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)  # never sends anything
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), 5)).startswith(b"HTTP/1.1 200")
        assert await closed_by_server(reader), "an idle keep-alive connection stayed open"
        assert await closed_by_server(silent_reader), "a connection that never sent anything stayed open"
    finally:
        writer.close()
        silent.close()
    assert listener._conn_stats.closed["idle-timeout"] == 2
    await wait_until(lambda: listener._conn_stats.open == 0, message="no connection left")


async def test_past_the_cap_the_quietest_connection_makes_room(start: Start) -> None:
    listener, port = await start(SETTINGS.model_copy(update={"max_connections": 3, "header_timeout_seconds": 30}))
    parked = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    await wait_until(lambda: listener._conn_stats.open == 3, message="three connections")
    # The first one was quiet longest; the other two just spoke (a partial request each).
    for _, writer in parked[1:]:
        writer.write(b"GET /")
        await writer.drain()
    await asyncio.sleep(0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), 5)).startswith(b"HTTP/1.1 200")
        assert await closed_by_server(parked[0][0]), "the quietest connection was not closed"
        assert not await closed_by_server(parked[1][0], timeout=0.05)
    finally:
        writer.close()
        for _, w in parked:
            w.close()
    assert listener._conn_stats.closed["cap"] == 1
    assert listener._conn_stats.open <= 3


GARBAGE = [
    b"GARBAGE\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(40)) + b"\r\n\r\n",  # a TLS hello
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Name: 1\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",  # request line over max_line_size
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"G\x00T / HTTP/1.1\r\n\r\n",
]


async def send_garbage(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        return await asyncio.wait_for(reader.read(), 5)  # the server answers and closes
    finally:
        writer.close()


@pytest.mark.parametrize("payload", GARBAGE, ids=range(len(GARBAGE)))
async def test_a_malformed_request_gets_a_400_with_our_headers(start: Start, payload: bytes) -> None:
    _, port = await start()
    status, headers, body = parse_response(await send_garbage(port, payload))
    assert status == 400 and body == b"bad request"
    assert headers["x-region"] == REGION
    assert is_valid_request_id(headers["x-request-id"]) and headers["x-request-id"].startswith("req_sfo1-")


async def test_a_flood_of_malformed_requests_logs_a_bounded_number_of_lines_without_tracebacks(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # everything, aiohttp's own loggers included
    logging.getLogger(LOGGER_NAME).setLevel(logging.INFO)  # ours at info: rate-limited lines
    registry = CollectorRegistry()
    clock = ManualClock()  # no time passes: the bucket never refills beyond its burst
    listener, port = await start(SETTINGS.model_copy(update={"request_log_per_second": 20.0}),
                                 registry=registry, clock=clock)
    floods = 2000
    answers: list[bytes] = []
    gate = asyncio.Semaphore(50)

    async def one(i: int) -> None:
        async with gate:
            answers.append(await send_garbage(port, GARBAGE[i % len(GARBAGE)]))

    await asyncio.gather(*(one(i) for i in range(floods)))
    assert len(answers) == floods
    for raw in answers:
        status, headers, _ = parse_response(raw)
        assert status == 400 and headers["x-region"] == REGION and is_valid_request_id(headers["x-request-id"])
    ours = [r for r in caplog.records if r.name == LOGGER_NAME and hasattr(r, "status")]
    assert len(ours) == 20  # the bucket's burst; the rest counted
    assert all(r.levelno == logging.INFO and r.status == 400 for r in ours)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not [r for r in caplog.records if r.name.startswith("aiohttp") and r.levelno >= logging.INFO]
    line = json.loads(JsonFormatter(REGION).format(ours[0]))
    assert line["status"] == 400 and line["request_id"] and line["reason"]
    assert registry.get_sample_value("region_agent_health_request_logs_suppressed_total") == floods - 20
    assert listener.stats.count("malformed", 400) == floods
