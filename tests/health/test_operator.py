"""Public and operator listeners apart: what each serves, the bearer token, renders that are not per request."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from region_agent.base.bearer import BearerToken, TokenFileError
from region_agent.base.clock import ManualClock
from region_agent.health.operator import Document, DocumentCache
from region_agent.health.service import HealthService
from region_agent.health.settings import HealthSettings
from region_agent.state.local import CopyReason
from tests.health.helpers import copy, view

SETTINGS = HealthSettings(listen_addresses=("127.0.0.1",), port=0, operator_port=0)
VIEW = view([copy("shop"), copy("blog", CopyReason.NO_READY_REVISION, detail="revision blog-00002 failed: 401 "
                                  "from registry.internal")], watch_errors=("services: 500 from kube-api.internal",),
            degraded=("checks: local errors (EMFILE)",))


class CountingCollector(Collector):
    """Counts how often the registry is collected (one render of /metrics collects it once)."""

    def __init__(self) -> None:
        self.collects = 0

    def collect(self) -> Iterable[Metric]:
        self.collects += 1
        yield GaugeMetricFamily("region_agent_test_renders", "Renders so far.", value=self.collects)


class Zone:
    def __init__(self) -> None:
        self.generation = 1
        self.renders = 0

    def render(self) -> object:
        self.renders += 1
        return {"serial": self.generation, "records": ["shop.g.example.com"]}


async def get(http: aiohttp.ClientSession, url: str, token: str | None = None) -> tuple[int, str, CIMultiDict[str]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with http.get(url, headers=headers) as response:
        return response.status, await response.text(), CIMultiDict(response.headers)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def started(settings: HealthSettings, zone: Zone, registry: CollectorRegistry) -> tuple[HealthService, str, str]:
    service = HealthService(settings, region="sfo1", registry=registry,
                            documents={"/zone": Document(zone.render, lambda: zone.generation)})
    service.publish(VIEW)
    await service.start()
    assert service.listener is not None
    public = "http://{}:{}".format(*service.listener.addresses[0])
    operator = "http://{}:{}".format(*service.operator.addresses[0])
    return service, public, operator


async def test_the_public_listener_serves_health_only_and_reason_codes_only(http: aiohttp.ClientSession) -> None:
    service, public, operator = await started(SETTINGS, Zone(), CollectorRegistry())
    try:
        for path in ("/zone", "/metrics", "/debug", "/health/region/x"):
            status, _, headers = await get(http, public + path)
            assert status == 404 and headers["X-Region"] == "sfo1" and "X-Request-Id" in headers, path
        texts = [await get(http, public + path) for path in ("/health/region", "/global-health/blog")]
        for status, body, _ in texts:
            assert status in (200, 503)
            for secret in ("registry.internal", "kube-api", "EMFILE", "proj-", "blog-0000"):
                assert secret not in body, (secret, body)
        status, body, headers = await get(http, public + "/health/region")
        assert headers["X-Degraded-Reason"] == "watch-failing,agent-degraded"
        # The operator listener has the words.
        status, body, _ = await get(http, operator + "/health/region")
        assert "kube-api.internal" in body and "checks: local errors (EMFILE)" in body
        assert (await get(http, operator + "/zone"))[0] == 200
        assert (await get(http, operator + "/metrics"))[0] == 200
    finally:
        await service.stop()


async def test_the_operator_listener_requires_the_token_when_configured(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    settings = SETTINGS.model_copy(update={"operator_token_file": token_file})
    service, _, operator = await started(settings, Zone(), CollectorRegistry())
    try:
        for path in ("/metrics", "/zone", "/health/region", "/global-health/shop", "/nope"):
            status, _, headers = await get(http, operator + path)
            assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer"), path
            assert headers["X-Region"] == "sfo1" and "X-Request-Id" in headers
            assert (await get(http, operator + path, token="wrong"))[0] == 401, path
        assert (await get(http, operator + "/metrics", token="s3cret"))[0] == 200
        assert (await get(http, operator + "/zone", token="s3cret"))[0] == 200
        # Probes carry no token.
        assert (await get(http, operator + "/livez"))[0] == 200
        assert (await get(http, operator + "/readyz"))[0] == 200
    finally:
        await service.stop()


def test_a_token_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("one")
    clock = ManualClock()
    token = BearerToken(path, monotonic=clock.monotonic)
    assert token.accepts("Bearer one") and not token.accepts("Bearer two") and not token.accepts(None)
    path.write_text("two-rotated")
    clock.advance(5.0)
    assert token.accepts("Bearer two-rotated") and not token.accepts("Bearer one")
    path.write_text("")  # a half-written secret keeps the previous token
    clock.advance(5.0)
    assert token.accepts("Bearer two-rotated")


def test_a_token_file_gone_bad_is_a_problem_logged_once_and_its_recovery_too(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="region_agent.health")
    path = tmp_path / "token"
    path.write_text("one")
    clock = ManualClock()
    token = BearerToken(path, monotonic=clock.monotonic)
    assert token.problems() == () and token.problem is None
    path.unlink()
    for _ in range(3):
        clock.advance(5.0)
        assert token.accepts("Bearer one")
    assert token.problems() == (f"operator token file refused, keeping the previous token: "
                                f"health.operator_token_file {path}: No such file or directory",)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING
    path.write_text("two")
    clock.advance(5.0)
    assert token.accepts("Bearer two") and token.problems() == ()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"operator token file {path} usable again"]


@pytest.mark.parametrize("content", [None, ""])
def test_a_missing_or_empty_token_file_stops_start_up_naming_the_setting(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokenFileError, match=r"health\.operator_token_file"):
        BearerToken(path)


async def test_many_scrapers_cost_one_metrics_render_per_interval(http: aiohttp.ClientSession) -> None:
    registry = CollectorRegistry()
    counting = CountingCollector()
    registry.register(counting)
    service, _, operator = await started(SETTINGS.model_copy(update={"metrics_cache_seconds": 60.0}), Zone(),
                                         registry)
    try:
        answers = await asyncio.gather(*(get(http, operator + "/metrics") for _ in range(40)))
        assert {status for status, _, _ in answers} == {200}
        assert counting.collects == 1
        assert all("region_agent_test_renders 1.0" in body for _, body, _ in answers)
    finally:
        await service.stop()


async def test_the_zone_is_rendered_once_per_generation(http: aiohttp.ClientSession) -> None:
    zone = Zone()
    service, _, operator = await started(SETTINGS, zone, CollectorRegistry())
    try:
        for _ in range(5):
            assert (await get(http, operator + "/zone"))[1] == '{"serial":1,"records":["shop.g.example.com"]}'
        assert zone.renders == 1
        zone.generation = 2
        for _ in range(5):
            assert '"serial":2' in (await get(http, operator + "/zone"))[1]
        assert zone.renders == 2
    finally:
        await service.stop()


async def test_documents_are_refused_on_the_public_listener() -> None:
    from region_agent.health.listener import HealthListener

    with pytest.raises(ValueError, match="operator"):
        HealthListener(region="sfo1", source=lambda: None, settings=SETTINGS, registry=CollectorRegistry(),
                       documents={"/zone": Document(lambda: {}, lambda: 0)})


async def test_a_new_generation_reencodes_only_the_records_that_are_new_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from region_agent.health import operator

    records = [{"name": f"p{i}", "answers": {"A": ["127.0.0.1"]}} for i in range(100)]
    state: dict[str, Any] = {"generation": 1, "records": records}
    cache = DocumentCache(Document(lambda: {"serial": state["generation"], "records": list(state["records"])},
                                   lambda: state["generation"]))
    assert await cache.get() == json.dumps({"serial": 1, "records": records}, separators=(",", ":")).encode()
    encoded: list[object] = []
    real = operator._dumps

    def counting(value: object) -> bytes:
        encoded.append(value)
        return real(value)

    monkeypatch.setattr(operator, "_dumps", counting)
    changed = {"name": "p7", "answers": {"A": []}}
    state["records"] = [*records[:7], changed, *records[8:]]
    state["generation"] = 2
    assert await cache.get() == json.dumps({"serial": 2, "records": state["records"]}, separators=(",", ":")).encode()
    assert any(e is changed for e in encoded)
    assert not [r for r in records if any(r is e for e in encoded)]  # the unchanged records were reused
