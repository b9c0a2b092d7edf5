"""The agent shows its GeoIP database and its name server's reachability: /health/region, /metrics, the CLI.

Real servers on loopback: an aiohttp server holding the database behind a presigned URL, and a
UDP-only name server (nothing on TCP) as this agent's public address, so ``reachable`` is false
with ``tcp`` named. The URL's query never appears in any of it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from region_agent.cli.main import main
from tests.conftest import wait_for
from tests.fakes.ports import free_port
from tests.globaldns.geoip.test_source import SECRET, SIGNED_QUERY, DbServer, city_db
from tests.globaldns.test_reachability import AGENT_ZONE, UdpOnlySoa


@pytest.fixture
async def server() -> AsyncIterator[DbServer]:
    served = DbServer()
    await served.server.start_server()
    try:
        yield served
    finally:
        served.release.set()
        await served.server.close()


@pytest.fixture
async def udp_only() -> AsyncIterator[int]:
    port = free_port()
    transport, _protocol = await asyncio.get_running_loop().create_datagram_endpoint(
        UdpOnlySoa, local_addr=("127.0.0.1", port))
    try:
        yield port
    finally:
        transport.close()


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
        return r.status, await r.text()


async def test_geoip_and_reachable_in_health_metrics_and_cli(
        tmp_path: Path, server: DbServer, udp_only: int, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # as setup_logging has it
    server.files["city.mmdb.gz"] = gzip.compress(city_db(build_epoch=1_750_000_000))
    zone = tmp_path / "zone.yaml"
    zone.write_text(AGENT_ZONE)
    signed = server.url(f"/signed/city.mmdb.gz?{SIGNED_QUERY}")
    agent = Agent(AgentSettings(
        region="sfo1", zone_file=zone,
        dns={"listen_addresses": ["127.0.0.1"], "port": 0,
             "geoip": {"source": "url", "url": signed, "cache_dir": str(tmp_path / "cache")}},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0},
        reachability={"enabled": True, "public_addresses": ["127.0.0.1"], "port": udp_only, "interval": 30,
                      "timeout": 0.5}))
    await agent.start()
    try:
        assert agent.health.listener is not None
        public = "http://{}:{}".format(*agent.health.listener.addresses[0])
        operator = "http://{}:{}".format(*agent.health.operator.addresses[0])

        async def shown() -> dict[str, Any]:
            _status, body = await _get(public + "/health/region")
            data: dict[str, Any] = json.loads(body)
            done = data["geoip"]["state"] == "loaded" and data["reachable"]["reachable"] is False
            return data if done else {}

        data = await wait_for(shown, timeout=10, message="geoip loaded and tcp unreachable, published")
        geoip, reachable = data["geoip"], data["reachable"]
        assert geoip["source"] == "url" and geoip["build_date"] == "2025-06-15" and "location" not in geoip
        assert geoip["size_bytes"] == len(city_db()) and geoip["error"] is None
        assert reachable["failed_transports"] == ["tcp"] and reachable["checked"] and "errors" not in reachable

        _status, body = await _get(operator + "/health/region")
        verbose = json.loads(body)
        assert verbose["geoip"]["location"] == server.url("/signed/city.mmdb.gz").split("?")[0] + "?<redacted>"
        assert verbose["reachable"]["errors"] == [
            f"dns not reachable over tcp at 127.0.0.1:{udp_only}: ConnectionRefusedError: Connection refused"]

        _status, metrics = await _get(operator + "/metrics")
        assert 'region_agent_geoip_state{state="loaded"} 1.0' in metrics
        assert "region_agent_geoip_build_timestamp_seconds 1.75e+09" in metrics

        capsys.readouterr()
        assert await asyncio.to_thread(main, ["geoip", "--url", operator]) == 0
        printed = capsys.readouterr().out
        assert printed.startswith("geoip: loaded  source url http://127.0.0.1:")
        assert "built 2025-06-15" in printed and "reachable: no, failed over tcp" in printed

        # The database goes away upstream; a refresh fails and is named next to the loaded one.
        del server.files["city.mmdb.gz"]
        await agent.dns.geoip.refresh()

        async def refresh_failed() -> str:
            _status, body = await _get(operator + "/health/region")
            return body if json.loads(body)["geoip"]["refresh_error"] else ""

        body = await wait_for(refresh_failed, timeout=5, message="the failed refresh published")
        assert json.loads(body)["geoip"]["refresh_error"]["code"] == "http-status"
        assert await asyncio.to_thread(main, ["geoip", "--url", operator]) == 0
        printed += capsys.readouterr().out
        assert "last refresh failed" in printed and "HTTP 404" in printed
        _status, metrics_after = await _get(operator + "/metrics")
        for text in (json.dumps(data), json.dumps(verbose), metrics, metrics_after, body, printed, caplog.text):
            assert SECRET not in text and "AKIDEXAMPLE" not in text
    finally:
        await agent.stop()


async def test_a_missing_database_degrades_the_agent(tmp_path: Path) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_text(AGENT_ZONE)
    agent = Agent(AgentSettings(
        region="sfo1", zone_file=zone,
        dns={"listen_addresses": ["127.0.0.1"], "port": 0, "geoip_database": str(tmp_path / "absent.mmdb")},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    await agent.start()  # a missing file no longer stops the agent: it answers without proximity
    try:
        view = agent.region_view()
        assert view.geoip is not None and view.geoip["state"] == "missing"
        assert view.geoip["error"]["code"] == "file-missing"
        assert any(p.startswith("geoip database missing (file-missing)") for p in view.degraded)
        assert view.reachable is None  # the check is off in standalone mode
    finally:
        await agent.stop()
