"""The listener over real sockets (port 0 on loopback), driven by an aiohttp client."""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from region_agent.base.clock import ManualClock
from region_agent.base.logs import JsonFormatter
from region_agent.base.request_ids import is_valid_request_id
from region_agent.health.access_log import LOGGER_NAME
from region_agent.health.listener import HealthListener, Role
from region_agent.health.metrics import ViewCollector
from region_agent.health.settings import HealthSettings
from region_agent.health.source import ViewHolder, ViewSource
from region_agent.state.local import CopyReason, RegionView
from tests.health.helpers import REGION, copy, many_copies, view

LOOPBACK = HealthSettings(listen_addresses=("127.0.0.1",), port=0, operator_listen_addresses=("127.0.0.1",),
                          operator_port=0)
MakeListener = Callable[..., Awaitable[tuple[HealthListener, str]]]


@pytest.fixture
async def make_listener() -> AsyncIterator[MakeListener]:
    """Start listeners on loopback port 0; every one is stopped at teardown."""
    started: list[HealthListener] = []

    async def make(
        source: ViewSource | Callable[[], RegionView | None],
        *,
        settings: HealthSettings = LOOPBACK,
        registry: CollectorRegistry | None = None,
        clock: ManualClock | None = None,
        role: Role = Role.PUBLIC,
    ) -> tuple[HealthListener, str]:
        listener = HealthListener(
            region=REGION, source=source, settings=settings, registry=registry or CollectorRegistry(), clock=clock,
            role=role,
        )
        await listener.start()
        started.append(listener)
        host, port = listener.addresses[0]
        return listener, f"http://{host}:{port}"

    yield make
    for listener in reversed(started):
        await listener.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def get(
    http: aiohttp.ClientSession, url: str, *, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, str, CIMultiDict[str]]:
    """Status, body and headers (case-insensitive, as HTTP header names are)."""
    async with http.request(method, url, headers=headers) as response:
        return response.status, await response.text(), CIMultiDict(response.headers)


HOLDER_VIEW = view([copy("shop"), copy("blog", CopyReason.ROUTE_NOT_READY, detail="RoutesReady=False")])


async def test_global_health_answers_and_headers(make_listener: MakeListener, http: aiohttp.ClientSession) -> None:
    _, base = await make_listener(ViewHolder(HOLDER_VIEW))
    status, body, headers = await get(http, f"{base}/global-health/shop")
    assert (status, body) == (200, "ok")
    assert headers["X-Region"] == REGION
    assert is_valid_request_id(headers["X-Request-Id"]) and headers["X-Request-Id"].startswith("req_sfo1-")
    assert headers["Content-Type"] == "text/plain; charset=utf-8"

    assert (await get(http, f"{base}/global-health/blog"))[:2] == (503, "route-not-ready")
    assert (await get(http, f"{base}/global-health/nobody"))[:2] == (404, "not-found")
    assert (await get(http, f"{base}/global-health/shop?probe=1"))[:2] == (200, "ok")


async def test_json_when_asked(make_listener: MakeListener, http: aiohttp.ClientSession) -> None:
    _, public = await make_listener(ViewHolder(HOLDER_VIEW))
    _, operator = await make_listener(ViewHolder(HOLDER_VIEW), role=Role.OPERATOR)
    accept = {"Accept": "application/json, text/plain;q=0.5"}
    status, body, headers = await get(http, f"{public}/global-health/blog", headers=accept)
    assert status == 503
    assert headers["Content-Type"] == "application/json"
    facts = json.loads(body)
    assert facts["reason"] == "route-not-ready" and facts["request_id"] == headers["X-Request-Id"]
    # Public: the reason code only, never the condition text, namespace or revisions.
    assert not {"detail", "namespace", "service", "revisions"} & facts.keys()
    assert "RoutesReady" not in body and "proj-blog" not in body
    facts = json.loads((await get(http, f"{operator}/global-health/blog", headers=accept))[1])
    assert facts["detail"] == "RoutesReady=False" and facts["namespace"] == "proj-blog"


async def test_request_id_kept_when_valid_replaced_otherwise(
    make_listener: MakeListener, http: aiohttp.ClientSession
) -> None:
    _, base = await make_listener(ViewHolder(HOLDER_VIEW))
    mine = "req_lax1-1700000000000-0123456789ab"
    for path in ("/global-health/shop", "/health/region", "/livez", "/readyz", "/metrics", "/nope"):
        headers = (await get(http, base + path, headers={"X-Request-Id": mine}))[2]
        assert headers["X-Request-Id"] == mine, path
        assert headers["X-Region"] == REGION, path
        replaced = (await get(http, base + path, headers={"X-Request-Id": "abc<script>"}))[2]["X-Request-Id"]
        assert replaced != "abc<script>" and is_valid_request_id(replaced), path


async def test_head_other_methods_and_unknown_paths(make_listener: MakeListener, http: aiohttp.ClientSession) -> None:
    _, base = await make_listener(ViewHolder(HOLDER_VIEW))
    status, body, headers = await get(http, f"{base}/global-health/shop", method="HEAD")
    assert (status, body) == (200, "")
    assert headers["X-Health-Reason"] == "ok"
    status, _, headers = await get(http, f"{base}/global-health/shop", method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD" and "X-Request-Id" in headers
    status, _, headers = await get(http, f"{base}/global-health")
    assert status == 404 and headers["X-Region"] == REGION


async def test_readiness_follows_the_first_full_list(make_listener: MakeListener, http: aiohttp.ClientSession) -> None:
    holder = ViewHolder()
    _, base = await make_listener(holder)
    assert (await get(http, f"{base}/livez"))[:2] == (200, "ok")
    assert (await get(http, f"{base}/readyz"))[:2] == (503, "not ready: cache-not-synced")
    assert (await get(http, f"{base}/global-health/shop"))[:2] == (503, "cache-not-synced")
    holder.set(view([copy("shop")], synced=False))
    assert (await get(http, f"{base}/readyz"))[0] == 503
    holder.set(view([copy("shop")]))
    assert (await get(http, f"{base}/readyz"))[:2] == (200, "ready")
    assert (await get(http, f"{base}/global-health/shop"))[:2] == (200, "ok")


async def test_region_endpoint(make_listener: MakeListener, http: aiohttp.ClientSession) -> None:
    holder = ViewHolder(view(many_copies(100), watch_errors=("services: 500",)))
    _, base = await make_listener(holder)
    status, body, headers = await get(http, f"{base}/health/region")
    assert status == 200
    assert headers["X-Degraded"] == "true" and headers["X-Degraded-Reason"] == "watch-failing"
    assert json.loads(body)["copies"] == {
        "total": 100, "healthy": 90, "unhealthy": 10, "by_reason": {"no-ready-revision": 10}
    }
    assert "services: 500" not in body and json.loads(body)["cache"]["watch_errors"] == 1
    holder.set(view([copy("a")]))
    status, body, headers = await get(http, f"{base}/health/region")
    assert "X-Degraded" not in headers
    assert json.loads(body)["copies"]["total"] == 1


async def test_a_plain_callable_is_a_source(make_listener: MakeListener, http: aiohttp.ClientSession) -> None:
    current: list[RegionView | None] = [None]
    _, base = await make_listener(lambda: current[0])
    assert (await get(http, f"{base}/global-health/shop"))[0] == 503
    current[0] = HOLDER_VIEW
    assert (await get(http, f"{base}/global-health/shop"))[:2] == (200, "ok")


async def test_metrics(make_listener: MakeListener, http: aiohttp.ClientSession) -> None:
    registry = CollectorRegistry()
    holder = ViewHolder(HOLDER_VIEW)
    registry.register(ViewCollector(holder.current))
    settings = LOOPBACK.model_copy(update={"metrics_cache_seconds": 0.0})
    listener, base = await make_listener(holder, registry=registry, role=Role.OPERATOR, settings=settings)
    for _ in range(3):
        await get(http, f"{base}/global-health/shop")
    await get(http, f"{base}/global-health/blog")
    await get(http, f"{base}/nope")
    status, text, headers = await get(http, f"{base}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    labels = 'kind="global-health",listener="operator"'
    assert f'region_agent_health_requests_total{{code="200",{labels}}} 3.0' in text
    assert f'region_agent_health_requests_total{{code="503",{labels}}} 1.0' in text
    assert 'region_agent_health_requests_total{code="404",kind="other",listener="operator"} 1.0' in text
    assert f'region_agent_health_request_duration_seconds_count{{{labels}}} 4.0' in text
    assert 'region_agent_health_connections{listener="operator"} 1.0' in text
    assert 'region_agent_health_copies{state="healthy"} 1.0' in text
    assert "region_agent_health_cache_synced 1.0" in text
    assert listener.stats.count("global-health", 200) == 3
    names = {m.name for m in registry.collect()}
    assert all(name.startswith("region_agent_health_") for name in names), names


async def test_a_failing_source_answers_500_with_headers(
    make_listener: MakeListener, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> RegionView | None:
        raise RuntimeError("boom")

    _, base = await make_listener(broken)
    status, _, headers = await get(http, f"{base}/global-health/shop")
    assert status == 500 and headers["X-Region"] == REGION and "X-Request-Id" in headers
    assert any(r.exc_info for r in caplog.records if r.name == LOGGER_NAME)


# --- request logs ----------------------------------------------------------------------------------


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    formatter = JsonFormatter(REGION)
    return [
        json.loads(formatter.format(r)) for r in caplog.records if r.name == LOGGER_NAME and hasattr(r, "status")
    ]


async def test_non_2xx_answers_are_logged_as_json_lines(
    make_listener: MakeListener, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    _, base = await make_listener(ViewHolder(HOLDER_VIEW))
    await get(http, f"{base}/global-health/shop")
    mine = "req_lax1-1700000000000-0123456789ab"
    await get(http, f"{base}/global-health/blog", headers={"X-Request-Id": mine})
    lines = _request_lines(caplog)
    assert len(lines) == 1, lines  # the 200 is counted, not logged
    line = lines[0]
    assert line["request_id"] == mine and line["region"] == REGION
    assert line["path"] == "/global-health/blog" and line["status"] == 503 and line["reason"] == "route-not-ready"
    assert isinstance(line["latency_ms"], float) and line["method"] == "GET"


async def test_debug_logs_every_request(
    make_listener: MakeListener, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    _, base = await make_listener(ViewHolder(HOLDER_VIEW))
    for _ in range(3):
        await get(http, f"{base}/global-health/shop")
    assert [line["status"] for line in _request_lines(caplog)] == [200, 200, 200]


async def test_request_logs_are_rate_limited_and_say_how_many_were_dropped(
    make_listener: MakeListener, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    clock = ManualClock()
    registry = CollectorRegistry()
    settings = LOOPBACK.model_copy(update={"request_log_per_second": 2.0})
    _, base = await make_listener(ViewHolder(HOLDER_VIEW), settings=settings, registry=registry, clock=clock)
    for _ in range(10):
        await get(http, f"{base}/global-health/nobody")
    assert len(_request_lines(caplog)) == 2  # the burst
    clock.advance(1.0)
    await get(http, f"{base}/global-health/nobody")
    lines = _request_lines(caplog)
    assert len(lines) == 3 and lines[-1]["suppressed"] == 8
    assert registry.get_sample_value("region_agent_health_request_logs_suppressed_total") == 8.0


# --- binding ---------------------------------------------------------------------------------------


async def test_an_address_in_use_fails_naming_the_setting(make_listener: MakeListener) -> None:
    first, _ = await make_listener(ViewHolder())
    taken = first.addresses[0][1]
    second = HealthListener(
        region=REGION, source=ViewHolder(), registry=CollectorRegistry(),
        settings=HealthSettings(listen_addresses=("127.0.0.1",), port=taken),
    )
    with pytest.raises(OSError, match=r"health\.listen_addresses") as failure:
        await second.start()
    assert failure.value.errno == errno.EADDRINUSE
    assert second.addresses == []


async def test_an_address_the_host_lacks_is_skipped_unless_required(
    make_listener: MakeListener, http: aiohttp.ClientSession
) -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface here: binding it fails with EADDRNOTAVAIL.
    lenient = HealthSettings(listen_addresses=("192.0.2.1", "127.0.0.1"), port=0)
    listener, _ = await make_listener(ViewHolder(HOLDER_VIEW), settings=lenient)
    assert [host for host, _ in listener.addresses] == ["127.0.0.1"]
    strict = lenient.model_copy(update={"require_all_addresses": True})
    with pytest.raises(OSError, match=r"192\.0\.2\.1"):
        await make_listener(ViewHolder(), settings=strict)
    with pytest.raises(OSError, match="could bind none"):
        await make_listener(ViewHolder(), settings=HealthSettings(listen_addresses=("192.0.2.1",), port=0))
