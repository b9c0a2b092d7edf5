"""The chart's operator listener is closed unless a value opens it; NOTES.txt says what was installed and how to
reach it; the Service names the docs give are the ones rendered (tests/deploy/gotemplate.py, no helm)."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from region_agent.app.settings import load_settings
from tests.deploy.gotemplate import Chart, TemplateFailError
from tests.deploy.test_chart import CHART, SCHEMA, _installed

RENDER = Chart(CHART)
ROOT = CHART.parents[1]
LISTEN = "REGION_AGENT_HEALTH__OPERATOR_LISTEN_ADDRESSES"


def _values(*, token: str = "", allow: bool = False, addresses: list[str] | None = None,
            **parts: bool) -> dict[str, Any]:
    values = copy.deepcopy(_installed())
    values["secrets"]["operatorToken"]["existingSecret"] = token
    values["operatorListener"]["allowWithoutToken"] = allow
    if addresses is not None:
        values["config"]["health"]["operator_listen_addresses"] = addresses
    for part, enabled in parts.items():   # healthSidecar=True, serviceMonitor=True, ...
        values[part]["enabled"] = enabled
    return values


def _render(template: str, values: dict[str, Any], release: str = "ra", namespace: str = "dns") -> str:
    return RENDER.render(template, RENDER.context(values, release=release, namespace=namespace))


def _docs(template: str, values: dict[str, Any], release: str = "ra") -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(_render(template, values, release)) if doc]


def _env(values: dict[str, Any], container: str = "agent") -> dict[str, Any]:
    (daemonset,) = _docs("daemonset.yaml", values)
    spec = next(c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == container)
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in spec["env"]}


def _listens(values: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """The operator addresses the agent takes from the rendered agent.yaml and environment."""
    (configmap,) = _docs("configmap.yaml", values)
    config = tmp_path / "agent.yaml"
    config.write_text(configmap["data"]["agent.yaml"])
    token = tmp_path / "token"
    token.write_text("t")
    for name in [n for n in os.environ if n.startswith("REGION_AGENT_")]:
        monkeypatch.delenv(name)
    for name, value in _env(values).items():
        if isinstance(value, str) and name.startswith("REGION_AGENT_HEALTH__"):
            monkeypatch.setenv(name, str(token) if name.endswith("TOKEN_FILE") else value)
    monkeypatch.setenv("REGION_AGENT_CONFIG", str(config))
    return load_settings(config).health.operator_listen_addresses


def test_closed_by_default_on_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = _values()
    assert "operator_listen_addresses" not in values["config"]["health"]   # values.yaml leaves it to the chart
    assert _env(values)[LISTEN] == '["127.0.0.1"]'
    assert _listens(values, tmp_path, monkeypatch) == ("127.0.0.1",)


@pytest.mark.parametrize(("values", "where"), [
    (_values(token="region-agent-operator"), "a token is required"),
    (_values(allow=True), "a lab opened it without one")], ids=["token", "allowWithoutToken"])
def test_opened_by_a_value(values: dict[str, Any], where: str, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert _env(values)[LISTEN] == '["0.0.0.0"]', where
    assert _listens(values, tmp_path, monkeypatch) == ("0.0.0.0",)
    # what needs it open renders: the sidecar (probed on the operator port), the ServiceMonitor
    for part in ("healthSidecar", "serviceMonitor"):
        opened = copy.deepcopy(values)
        opened[part]["enabled"] = True
        assert _docs("daemonset.yaml", opened)   # no fail


def test_an_address_in_config_is_used_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loopback = _values(addresses=["::1"])
    assert LISTEN not in _env(loopback)
    assert _listens(loopback, tmp_path, monkeypatch) == ("::1",)
    pod = _values(addresses=["0.0.0.0"], token="region-agent-operator")
    assert LISTEN not in _env(pod)
    assert _listens(pod, tmp_path, monkeypatch) == ("0.0.0.0",)


@pytest.mark.parametrize(("values", "named"), [
    (_values(addresses=["0.0.0.0"]), "secrets.operatorToken.existingSecret"),
    (_values(addresses=["10.0.0.5", "127.0.0.1"]), "without a token"),
    (_values(healthSidecar=True), "healthSidecar.enabled"),
    (_values(serviceMonitor=True), "serviceMonitor.enabled"),
    (_values(addresses=["127.0.0.1"], serviceMonitor=True), "127.0.0.1"),
], ids=["open without token", "one open address", "sidecar while closed", "servicemonitor while closed",
        "servicemonitor on loopback"])
def test_an_install_that_would_expose_or_break_it_fails_naming_the_values(values: dict[str, Any],
                                                                           named: str) -> None:
    with pytest.raises(TemplateFailError, match=re.escape(named)):
        _render("daemonset.yaml", values)


def test_the_value_is_in_the_schema_and_documented() -> None:
    assert SCHEMA["properties"]["operatorListener"]["properties"]["allowWithoutToken"] == {"type": "boolean"}
    text = (CHART / "values.yaml").read_text()
    assert "operatorListener:\n  # -- Open it (0.0.0.0) without a token" in text
    assert "build it" in text.split("image:")[0] and "push it" in text.split("image:")[0]


def test_the_health_service_name_is_a_value() -> None:
    (health, _operator, _dns) = _docs("services.yaml", _values())
    assert health["metadata"]["name"] == "runr-agent-health"
    values = _values()
    values["services"]["health"]["name"] = "agent-health"
    assert _docs("services.yaml", values)[0]["metadata"]["name"] == "agent-health"
    assert "Service agent-health (ClusterIP, port 8086)" in _render("NOTES.txt", values)


def test_notes_say_what_was_installed_and_how_to_reach_the_operator_listener() -> None:
    closed = _render("NOTES.txt", _values(), release="region-agent", namespace="region-agent")
    for line in ("region-agent 0.1.0 for region sfo1, zone g.example.com, in namespace region-agent:",
                 "- DaemonSet region-agent: one agent per node.",
                 "- Service runr-agent-health (ClusterIP, port 8086)",
                 "- Service region-agent-operator (ClusterIP, port 8087)",
                 "- Service region-agent-dns (LoadBalancer, UDP and TCP 53)",
                 "is a placeholder: no region-agent image is published",
                 "listens on 127.0.0.1 in each pod only",
                 "  kubectl -n region-agent port-forward svc/region-agent-operator 8087 &",
                 "  region-agent zone --url http://127.0.0.1:8087\n"):
        assert line in closed, line
    values = _values(token="region-agent-operator")
    values["image"]["repository"] = "registry.example.com/region-agent"
    values["config"]["gossip"]["enabled"] = True
    values["gossip"]["keyring"]["existingSecret"] = "keyring"
    values["gossip"]["tls"]["existingSecret"] = "tls"
    opened = _render("NOTES.txt", values, release="region-agent", namespace="region-agent")
    for line in ("one agent per node, in the gossip cluster.",
                 "- Service region-agent-gossip (headless)",
                 "The pods pull registry.example.com/region-agent:0.1.0: the image you built",
                 "needs the bearer token in Secret\nregion-agent-operator (key token)",
                 "  region-agent zone --url http://127.0.0.1:8087 --token-file operator.token"):
        assert line in opened, line
    lab = _render("NOTES.txt", _values(allow=True))
    assert "WITHOUT a token" in lab


def test_the_service_names_in_the_docs_are_the_rendered_ones() -> None:
    """docs/operating.md installs the release `region-agent`: the names it gives are what the chart makes."""
    values = _values(token="region-agent-operator")
    values["config"]["gossip"]["enabled"] = True
    values["gossip"]["keyring"]["existingSecret"] = "keyring"
    values["gossip"]["tls"]["existingSecret"] = "tls"
    rendered = {doc["metadata"]["name"] for template in ("services.yaml", "gossip-service.yaml")
                for doc in _docs(template, values, release="region-agent")}
    assert rendered == {"runr-agent-health", "region-agent-operator", "region-agent-dns", "region-agent-gossip"}
    docs = (ROOT / "docs" / "operating.md").read_text()
    for name in rendered - {"region-agent-dns"}:
        assert f"`{name}`" in docs or f"svc/{name}" in docs, name
    assert "helm --kube-context $r -n region-agent install region-agent helm/region-agent" in docs
    # another release name: <release>-region-agent-..., unless the release name holds the chart's name
    other = {doc["metadata"]["name"] for doc in _docs("gossip-service.yaml", values, release="dns")}
    assert other == {"dns-region-agent-gossip"}
    holds = {doc["metadata"]["name"] for doc in _docs("gossip-service.yaml", values, release="region-agent-sfo1")}
    assert holds == {"region-agent-sfo1-gossip"}
