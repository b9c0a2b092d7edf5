"""``region-agent demo`` end to end, on free ports: it prints every command it suggests, shows proximity
from its generated GeoIP database, and measures the failover it walks through."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from region_agent.app.settings import AgentSettings
from region_agent.demo.run import run_demo
from tests.fakes.ports import free_port

DEMO = Path(__file__).resolve().parents[2] / "region_agent" / "demo"


async def test_the_demo_shows_failover_with_its_time_and_proximity_by_client(
        capsys: pytest.CaptureFixture[str]) -> None:
    settings = AgentSettings(
        region="sfo1", zone_file=DEMO / "zone.yaml",
        dns={"zone": "g.example.com", "listen_addresses": ["127.0.0.1"], "port": free_port()},
        checks={"host": "runr-health.g.example.com", "port": free_port(), "interval": 0.3, "timeout": 0.3},
        health={"listen_addresses": ["127.0.0.1"], "port": free_port(), "operator_port": free_port()})
    assert await run_demo(settings, step_seconds=1.0, rounds=1) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^  \S.*   # ", out, re.MULTILINE)) == 7, out   # every suggested command
    took = re.search(r"failover: shop left sfo1 ([0-9.]+) s after its copy failed", out)
    assert took and float(took.group(1)) < 3.0, out
    healthy = out.split("* ")[1]
    assert "San Jose -> 127.0.0.11; Rotterdam -> 127.0.0.12; Tokyo -> 127.0.0.13" in healthy, healthy
    sfo1_down = out.split("* ")[2]   # San Jose's nearest healthy region is nrt1 now (8,300 km; ams1 8,800)
    assert "San Jose -> 127.0.0.13; Rotterdam -> 127.0.0.12; Tokyo -> 127.0.0.13" in sfo1_down, sfo1_down
