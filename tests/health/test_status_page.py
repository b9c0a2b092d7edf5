"""The status page on the operator listener: static HTML without the token, its data behind it, a strict CSP."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from region_agent.health import status_page
from region_agent.health.operator import Document
from region_agent.health.service import HealthService
from region_agent.health.settings import HealthSettings
from tests.health.helpers import copy, view

HTML_FILE = Path(status_page.__file__).with_name("status.html")


@pytest.fixture
async def operator(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(operator URL, public URL) of listeners whose operator one has a token."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    settings = HealthSettings(listen_addresses=("127.0.0.1",), port=0, operator_port=0,
                              operator_token_file=token_file)
    service = HealthService(settings, region="sfo1", registry=CollectorRegistry(),
                            documents={"/status.json": Document(lambda: {"region": "sfo1", "secret": "proj-x"},
                                                                lambda: 1)})
    service.publish(view([copy("shop")]))
    await service.start()
    assert service.listener is not None
    try:
        yield ("http://{}:{}".format(*service.operator.addresses[0]),
               "http://{}:{}".format(*service.listener.addresses[0]))
    finally:
        await service.stop()


async def test_the_page_is_served_without_the_token_and_its_data_only_with_it(
        operator: tuple[str, str]) -> None:
    url, public = operator
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/status") as r:
            body = await r.read()
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
            assert body == HTML_FILE.read_bytes()   # the same static bytes for everyone: no data in it
            assert r.headers["X-Region"] == "sfo1" and "X-Request-Id" in r.headers
            assert r.headers["Cache-Control"] == "no-store" and r.headers["X-Frame-Options"] == "DENY"
            assert r.headers["Referrer-Policy"] == "no-referrer"
            assert r.headers["Content-Security-Policy"] == status_page.security_policy()
        async with http.get(url + "/status.json") as r:
            assert r.status == 401 and "proj-x" not in await r.text()
        async with http.get(url + "/status.json", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with http.get(url + "/status.json", headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200 and (await r.json())["secret"] == "proj-x"
        async with http.get(public + "/status") as r:
            assert r.status == 404   # the public listener has no status page
        async with http.get(public + "/status.json") as r:
            assert r.status == 404


def test_the_policy_allows_exactly_the_inline_script_and_style() -> None:
    text = HTML_FILE.read_text()
    policy = status_page.security_policy()
    for tag in ("script", "style"):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
        assert len(blocks) == 1, tag
        digest = base64.b64encode(hashlib.sha256(blocks[0].encode()).digest()).decode()
        assert f"{tag}-src 'sha256-{digest}'" in policy
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy and "unsafe" not in policy


def test_the_page_puts_no_markup_from_data_into_the_dom_and_no_token_into_a_url() -> None:
    text = HTML_FILE.read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "localStorage", "?token"):
        assert sink not in text, sink
    assert "textContent" in text and "sessionStorage" in text and '"Authorization": "Bearer "' in text
    assert not re.search(r"<(link|img|iframe)\b|src=|https?://", text), "the page loads nothing from outside"
