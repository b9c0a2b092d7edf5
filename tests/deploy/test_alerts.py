"""The example alert rules (deploy/prometheus/alerts.yaml) and the agent's /metrics, checked by promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import dns.rcode
import pytest
import yaml

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from tests.conftest import wait_for
from tests.fakes.dns_client import ask

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus"
ALERTS = {rule["alert"]: rule for group in yaml.safe_load((RULES / "alerts.yaml").read_text())["groups"]
          for rule in group["rules"]}
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: prometheus)")
ZONE = "regions: {sfo1: {ipv4: [127.0.0.51]}}\nprojects: {shop: {regions: [sfo1]}}\n"


def _promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], input=stdin.decode() if stdin else None, capture_output=True,
                          text=True, timeout=60, check=False, cwd=RULES)


@pytest.mark.external
@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = _promtool("check", "rules", "alerts.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


@pytest.mark.external
@needs_promtool
@pytest.mark.parametrize("tests", ["alerts_test.yaml", "recorded_test.yaml"])
def test_promtool_unit_tests_of_every_alert_pass(tests: str) -> None:
    """recorded_test.yaml: series recorded from real agents (tests/e2e/test_alert_recordings.py)."""
    result = _promtool("test", "rules", tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_expects_it_to_fire() -> None:
    tests = [test for name in ("alerts_test.yaml", "recorded_test.yaml")
             for test in yaml.safe_load((RULES / name).read_text())["tests"]]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for test in tests for case in test["alert_rule_test"] if not case["exp_alerts"]}
    assert fired == set(ALERTS)
    assert quiet == set(ALERTS)  # and a time at which it must not


def _source_metric_names() -> set[str]:
    """Every metric name the agent's code defines, with the suffixes Prometheus exposes."""
    names: set[str] = set()
    for path in ROOT.glob("region_agent/**/*.py"):
        text = path.read_text()
        names.update(re.findall(r'"(region_agent_[a-z_]+[a-z])"', text))
        # the usage metrics are built as p + "name" with p = "region_agent_usage_"
        if 'p = "region_agent_usage_"' in text:
            names.update("region_agent_usage_" + n for n in re.findall(r'\(p \+ "([a-z_]+)"', text))
    names |= {n + "_total" for n in names}
    # and what real agents were seen exporting (built names too: region_agent_gossip_{name})
    for test in yaml.safe_load((RULES / "recorded_test.yaml").read_text())["tests"]:
        names.update(row["series"].split("{")[0] for row in test["input_series"])
    return names


def test_the_rules_use_metrics_the_agent_exports() -> None:
    known = _source_metric_names()
    used = {name for rule in ALERTS.values() for name in re.findall(r"region_agent_[a-z_]+", rule["expr"])}
    assert used and used <= known, used - known


@pytest.mark.external
@needs_promtool
async def test_promtool_accepts_a_real_metrics_scrape(tmp_path: Path) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE)
    agent = Agent(AgentSettings(region="sfo1", zone_file=zone,
                                dns={"listen_addresses": ["127.0.0.1"], "port": 0},
                                health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    await agent.start()
    try:
        await wait_for(agent.ready.is_set, timeout=10, message="ready")
        port = agent.dns.server.bound[0][1]
        for name, rcode in (("shop.g.example.com", dns.rcode.NOERROR), ("example.org", dns.rcode.REFUSED)):
            response = await ask(port, name)
            assert response.rcode() == rcode
        operator = "http://{}:{}/metrics".format(*agent.health.operator.addresses[0])
        async with aiohttp.ClientSession() as http, http.get(operator) as answer:
            assert answer.status == 200
            body = await answer.read()
    finally:
        await agent.stop()
    text = body.decode()
    for series in ('region_agent_dns_responses_total{qtype="A",rcode="REFUSED"} 1.0',
                   'region_agent_task_running{task="zone file watcher"} 1.0', "region_agent_dns_zone_serial "):
        assert series in text
    result = _promtool("check", "metrics", stdin=body)
    assert result.returncode == 0, result.stdout + result.stderr
