"""The zone file against a real ``region-agent`` process: start-up refusals, a non-atomic rewrite."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import aiohttp
import dns.rcode
import pytest

from tests.conftest import wait_for
from tests.e2e.test_standalone_process import ZONE, Running, _answer_is, _ready, agent  # noqa: F401 - fixture
from tests.fakes.dns_client import try_ask

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("command", "content", "message"), [
    ("run", b"regions:\n  sfo1: {ipv4: [192.0.2.1]}\n# caf\xe9\n", "not UTF-8: byte 0xe9 at line 3"),
    ("run", b"", "the file is empty"),
    ("check-config", b"", "the file is empty"),
    ("check-config", b"# regions will come\n", "no regions and no projects"),
    ("check-config", b"regions: {sfo1: {}}\nregions: {ams1: {}}\n", "duplicate key 'regions' at line 2"),
])
def test_a_bad_zone_file_at_start_is_one_line_and_exit_2(tmp_path: Path, command: str, content: bytes,
                                                          message: str) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_bytes(content)
    env = {**os.environ, "REGION_AGENT_DNS__PORT": "0", "REGION_AGENT_HEALTH__PORT": "0"}
    result = subprocess.run([sys.executable, "-m", "region_agent", command, "--zone-file", str(zone)],
                            capture_output=True, text=True, timeout=60, env=env, check=False, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr and str(zone) in result.stderr


async def _rcode(running: Running, name: str) -> int | None:
    response = await try_ask(running.dns_port, name, timeout=0.5)
    return None if response is None else int(response.rcode())


async def test_a_truncate_then_write_never_answers_nxdomain(agent: Running) -> None:  # noqa: F811 - fixture
    await wait_for(lambda: _ready(agent), timeout=15, message="/readyz")
    rcodes: Counter[int | None] = Counter()
    stop = asyncio.Event()

    async def ask_throughout() -> None:
        while not stop.is_set():
            rcodes[await _rcode(agent, "shop.g.example.com")] += 1
            await asyncio.sleep(0.005)  # pacing of the query stream, not a wait for a condition

    asker = asyncio.create_task(ask_throughout())
    try:
        text = ZONE
        # The writer pauses between truncating and writing for less, then for more, than the
        # agent's settle interval (0.5 s): the first gap is never stable, the second is an
        # empty file, refused. Either way the previous zone is answered throughout.
        for gap, project in ((0.2, "blog"), (1.5, "docs")):
            text += f"  {project}: {{regions: [ams1]}}\n"
            with agent.zone.open("w"):
                pass  # truncated, as `>` in a shell or open(..., "w") does
            await asyncio.sleep(gap)  # the careless writer's gap, part of the scenario
            agent.zone.write_text(text)
            name = f"{project}.g.example.com"
            await wait_for(lambda: _answer_is(agent, {"127.0.0.42"}, name), timeout=15,  # noqa: B023 - awaited here
                           message=f"{project} answered")
    finally:
        stop.set()
        await asyncio.gather(asker, return_exceptions=True)
    assert rcodes[dns.rcode.NXDOMAIN] == 0, rcodes
    assert rcodes[dns.rcode.NOERROR] >= 20, rcodes  # queries really went on during both gaps


async def _operator_region(running: Running) -> str:
    try:
        async with aiohttp.ClientSession() as http, http.get(
                f"http://127.0.0.1:{running.operator_port}/health/region",
                timeout=aiohttp.ClientTimeout(total=2)) as response:
            return await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return ""


async def test_a_non_utf8_file_degrades_the_agent_until_a_fixed_one_is_applied(
        agent: Running) -> None:  # noqa: F811 - fixture
    await wait_for(lambda: _ready(agent), timeout=15, message="/readyz")
    agent.zone.write_bytes(ZONE.encode() + b"  caf\xe9: {regions: [ams1]}\n")
    body = await wait_for(lambda: _contains(agent, "zone file refused"), timeout=15, message="degraded")
    assert "not UTF-8: byte 0xe9" in body
    assert await _answer_is(agent, {"127.0.0.41"})  # the previous zone is answered
    agent.zone.write_text(ZONE + "  cafe: {regions: [ams1]}\n")
    await wait_for(lambda: _answer_is(agent, {"127.0.0.42"}, "cafe.g.example.com"), timeout=15,
                   message="fixed file applied without a restart")
    await wait_for(lambda: _lacks(agent, "zone file refused"), timeout=15, message="no longer degraded")


async def _contains(running: Running, text: str) -> str:
    body = await _operator_region(running)
    return body if text in body else ""


async def _lacks(running: Running, text: str) -> bool:
    body = await _operator_region(running)
    return bool(body) and text not in body
