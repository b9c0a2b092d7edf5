"""The operator status page in a real headless Chromium, against a real 3-agent cluster on loopback.

Chromium and chromedriver are Debian's (``scripts/system-packages.sh``); the test speaks
chromedriver's W3C WebDriver protocol over HTTP itself with aiohttp (a few commands: session, url,
element, value, click, execute, screenshot), so it needs no Python package beyond the project's
and never blocks the event loop the fake copies answer from.

What it shows: the page asks for the token, then lists the three regions and members; a copy
going down shows on the page within 2 s (measured from the moment the copy starts failing its
checks to the moment the page's DOM shows it out, and printed); a fence reason full of markup is
shown as text and runs nothing. A screenshot is kept under the test's tmp dir and copied to
``/tmp/region-agent-artifacts/status.png``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from region_agent.demo.fake_copy import DOWN
from tests.conftest import wait_for
from tests.e2e.cluster import Agent, Cluster, three_regions
from tests.fakes.ports import free_port

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path("/tmp/region-agent-artifacts")
TOKEN = "status-page-token"
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"   # the W3C web element identifier key
BUDGET = 2.0   # seconds from a copy failing to the page showing it

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="chromium and chromium-driver are Debian packages (scripts/system-packages.sh)"),
]


class WebDriver:
    """The handful of W3C WebDriver commands this test needs, over HTTP to chromedriver."""

    def __init__(self, http: aiohttp.ClientSession, base: str, session: str) -> None:
        self.http, self.base, self.session = http, base, session

    async def command(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        async with self.http.request(method, f"{self.base}/session/{self.session}{path}",
                                     json=body if body is not None else ({} if method == "POST" else None),
                                     timeout=aiohttp.ClientTimeout(total=30)) as r:
            data = await r.json()
            if r.status != 200:
                raise AssertionError(f"webdriver {method} {path}: {r.status} {data}")
            return data["value"]

    async def go(self, url: str) -> None:
        await self.command("POST", "/url", {"url": url})

    async def element(self, css: str) -> str:
        found = await self.command("POST", "/element", {"using": "css selector", "value": css})
        assert isinstance(found, dict) and ELEMENT in found, f"no element {css}: {found}"
        return str(found[ELEMENT])

    async def type(self, css: str, text: str) -> None:
        await self.command("POST", f"/element/{await self.element(css)}/value", {"text": text})

    async def click(self, css: str) -> None:
        await self.command("POST", f"/element/{await self.element(css)}/click")

    async def js(self, script: str, *args: Any) -> Any:
        return await self.command("POST", "/execute/sync", {"script": script, "args": list(args)})

    async def screenshot(self, path: Path) -> None:
        import base64

        path.write_bytes(base64.b64decode(await self.command("GET", "/screenshot")))


@contextlib.asynccontextmanager
async def browser(tmp: Path) -> AsyncIterator[WebDriver]:
    assert CHROMEDRIVER is not None and CHROMIUM is not None
    port = free_port()
    log = (tmp / "chromedriver.log").open("wb")
    driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}", "--allowed-ips=127.0.0.1"],
                              stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async def up() -> bool:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(f"{base}/status") as r:
                        return bool((await r.json())["value"]["ready"])
                return False

            await wait_for(up, timeout=20, interval=0.1, message="chromedriver listening")
            args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--window-size=1280,1400", f"--user-data-dir={tmp / 'chromium-profile'}",
                    "--no-first-run", "--disable-extensions", "--disable-background-networking"]
            capabilities = {"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": {"binary": CHROMIUM, "args": args}}}}
            async with http.post(f"{base}/session", json=capabilities,
                                 timeout=aiohttp.ClientTimeout(total=60)) as r:
                created = await r.json()
                assert r.status == 200, created
            wd = WebDriver(http, base, created["value"]["sessionId"])
            try:
                yield wd
            finally:
                with contextlib.suppress(Exception):
                    await wd.command("DELETE", "")
    finally:
        driver.terminate()
        try:
            driver.wait(timeout=10)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait(timeout=5)
        log.close()


async def status_json(agent: Agent) -> dict[str, Any] | None:
    status, body = await agent.get("/status.json", operator=True)
    return json.loads(body) if status == 200 else None


async def settled(agent: Agent) -> bool:
    """Three members alive, three regions in the answers, shop in all three, every digest the same."""
    s = await status_json(agent)
    if s is None:
        return False
    shop = next((p for p in s["projects"] if p["slug"] == "shop"), None)
    return (len([m for m in s["members"] if m["state"] == "alive"]) == 3
            and [r["in_answers"] for r in s["regions"]] == [True] * 3
            and shop is not None and sorted(shop["in_answers"]) == ["ams1", "fra1", "sfo1"]
            and len(s["digests"]["agents"]) == 2 and s["digests"]["converged"])


PAGE = """
const rows = (id) => Array.from(document.querySelectorAll('#' + id + ' tbody tr'))
  .map((tr) => Array.from(tr.cells).map((td) => td.textContent));
const out = document.querySelector('tr[data-project="shop"] td[data-cell="out"]');
return {login: !document.getElementById('login').classList.contains('hidden'),
        page: !document.getElementById('page').classList.contains('hidden'),
        regions: rows('regions'), members: rows('members'), events: rows('events'),
        digest: document.getElementById('digest-summary').textContent,
        note: document.getElementById('projects-note').textContent,
        shop_out: out === null ? null : out.textContent,
        images: document.images.length, pwned: window.pwned === true};
"""


async def test_the_status_page_follows_the_cluster_in_a_real_browser(tmp_path: Path) -> None:
    c: Cluster = await three_regions(tmp_path, token=TOKEN)
    for agent in c.agents:
        agent.start()
    first, fra1_copy = c.agents[0], c.copies[2]
    try:
        await wait_for(lambda: settled(first), timeout=60, interval=0.2, message="a settled cluster on the page's data")
        async with browser(tmp_path) as wd:
            await wd.go(f"http://{first.host}:{first.operator_port}/status")
            page = await wait_for(lambda: wd.js(PAGE), timeout=10, interval=0.1, message="the page's script ran")
            assert page["login"] and not page["page"], page   # no token yet: the form, no data
            await wd.type("#token", TOKEN)
            await wd.click("#sign-in")

            async def listed() -> dict[str, Any] | None:
                p = await wd.js(PAGE)
                names = [row[0] for row in p["regions"]]
                alive = [row for row in p["members"] if row[3] == "alive"]
                ok = (p["page"] and names == ["ams1", "fra1", "sfo1"] and len(alive) == 3
                      and all(row[2] == "in" for row in p["regions"]) and p["shop_out"] == "")
                return p if ok else None

            p = await wait_for(listed, timeout=10, interval=0.1, message="three regions and members on the page")
            assert "every agent holds the same digest" in p["digest"], p
            assert "1 of 1 projects shown" in p["note"], p
            assert {row[1] for row in p["members"]} == {"sfo1", "ams1", "fra1"}
            assert sum(row[5].endswith(" ms") for row in p["members"]) >= 2, p["members"]   # the peers' RTT

            # fra1's copy starts failing its checks: how long until the page (on sfo1's agent) shows it?
            fra1_copy.set(DOWN)
            started = time.monotonic()

            async def shown() -> dict[str, Any] | None:
                p = await wd.js(PAGE)
                return p if p["shop_out"] and "fra1" in p["shop_out"] else None

            p = await wait_for(shown, timeout=15, interval=0.02, message="fra1's copy out on the page")
            elapsed = time.monotonic() - started
            print(f"\nstatus page: a copy going down showed on the page after {elapsed:.2f} s "
                  f"(budget {BUDGET:.1f} s): {p['shop_out']}")
            assert "fra1: unhealthy: check failed" in p["shop_out"], p
            assert any("copy shop/fra1 unhealthy" in row[2] for row in p["events"]), p["events"]
            shot = tmp_path / "status.png"
            await wd.screenshot(shot)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, ARTIFACTS / "status.png")
            print(f"status page screenshot: {shot} (copied to {ARTIFACTS / 'status.png'})")
            assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert elapsed < BUDGET, f"the page showed the copy down after {elapsed:.2f} s"

            # Markup from the agent's data is text: a fence reason that would run a script if parsed.
            reason = '<img src=x onerror="window.pwned=true">'
            async with aiohttp.ClientSession() as http, http.post(
                    f"http://{first.host}:{first.operator_port}/v1/regions/ams1/fence", json={"reason": reason},
                    headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200, await r.text()

            async def fenced() -> dict[str, Any] | None:
                p = await wd.js(PAGE)
                return p if any(reason in row[2] for row in p["events"]) else None

            p = await wait_for(fenced, timeout=10, interval=0.1, message="the fence on the page")
            assert p["images"] == 0 and not p["pwned"], p
            await wd.screenshot(tmp_path / "status-fenced.png")
            shutil.copyfile(tmp_path / "status-fenced.png", ARTIFACTS / "status-fenced.png")
            # A wrong token in the tab: back to the form, no data.
            await wd.js("sessionStorage.setItem('region-agent-operator-token', 'wrong'); return true;")
            await wait_for(lambda: _login_shown(wd), timeout=5, interval=0.1, message="the form again")
    finally:
        await c.stop()


async def _login_shown(wd: WebDriver) -> bool:
    p = await wd.js(PAGE)
    return bool(p["login"] and not p["page"])

