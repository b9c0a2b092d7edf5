"""The chart in cluster mode (config.gossip.enabled), rendered without helm (tests/deploy/gotemplate.py).

Ports 7946 UDP and TCP (hostPort with hostNetwork), gossip.advertise_address from the downward API,
the headless Service behind gossip.seeds_dns, the keyring and TLS Secrets mounted read-only as whole
volumes (so a Secret update reaches the running agent), the NetworkPolicy, the values schema; and
that the agent accepts the settings the rendered ConfigMap and environment give it.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from region_agent.app.settings import load_settings
from tests.deploy.gotemplate import Chart, TemplateFailError
from tests.deploy.test_chart import CHART, SCHEMA, _installed

TEMPLATES = sorted(p.name for p in (CHART / "templates").glob("*.yaml"))
RENDER = Chart(CHART)


def _values(*, gossip: bool = True, keyring: str = "gossip-keyring", tls: str = "gossip-tls",
            **chart: Any) -> dict[str, Any]:
    values = copy.deepcopy(_installed())  # _installed() shares nested maps with the module's VALUES
    values["config"]["gossip"].update(enabled=gossip, seeds=["198.51.100.21", "[2001:db8::7]:7946"])
    values["gossip"]["keyring"]["existingSecret"] = keyring
    values["gossip"]["tls"]["existingSecret"] = tls
    for key, value in chart.items():
        values[key] = value
    return values


def _plain() -> dict[str, Any]:
    return copy.deepcopy(_installed())


def _token() -> dict[str, Any]:
    """``secrets`` with the operator token set: the sidecar's probes and the ServiceMonitor need the operator
    listener open, and the chart opens it only with a token (tests/deploy/test_chart_operator.py)."""
    secrets: dict[str, Any] = copy.deepcopy(_plain()["secrets"])
    secrets["operatorToken"]["existingSecret"] = "operator"
    return secrets


def _docs(template: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(RENDER.render(template, RENDER.context(values))) if doc]


def _pod(values: dict[str, Any]) -> dict[str, Any]:
    (daemonset,) = _docs("daemonset.yaml", values)
    pod: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return pod


def _container(values: dict[str, Any], name: str = "agent") -> dict[str, Any]:
    return next(c for c in _pod(values)["containers"] if c["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _gossip_ports(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in container["ports"] if p["name"].startswith("gossip")]


def _schema_errors(values: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return sorted("/".join(map(str, e.absolute_path)) + ": " + e.message for e in validator.iter_errors(values))


# --- rendering ---------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [_plain(), _values(tls="gossip-tls", hostNetwork=True,
                                                          healthSidecar={**_plain()["healthSidecar"],
                                                                         "enabled": True},
                                                          networkPolicy={**_plain()["networkPolicy"],
                                                                         "enabled": True},
                                                          serviceMonitor={**_plain()["serviceMonitor"],
                                                                          "enabled": True},
                                                          secrets=_token())],
                         ids=["minimal", "everything on"])
def test_every_template_renders_to_kubernetes_objects(values: dict[str, Any]) -> None:
    for template in TEMPLATES:
        for doc in _docs(template, values):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), template


def test_a_standalone_install_has_no_gossip_anything() -> None:
    values = _values(gossip=False, keyring="")
    agent = _container(values)
    assert _gossip_ports(agent) == []
    assert not [name for name in _env(agent) if "GOSSIP" in name]
    assert not [v for v in _pod(values)["volumes"] if v["name"].startswith("gossip")]
    assert _docs("gossip-service.yaml", values) == []
    policy = _values(gossip=False, keyring="", networkPolicy={**_plain()["networkPolicy"], "enabled": True})
    (rendered,) = _docs("networkpolicy.yaml", policy)
    assert "gossip-udp" not in yaml.safe_dump(rendered)


def test_ports_on_the_pod_network_and_with_host_network() -> None:
    pod_network = _gossip_ports(_container(_values()))
    assert pod_network == [{"name": "gossip-udp", "containerPort": 7946, "protocol": "UDP"},
                           {"name": "gossip-tcp", "containerPort": 7946, "protocol": "TCP"}]
    moved = _values(hostNetwork=True)
    moved["config"]["gossip"]["port"] = 7950
    host = _gossip_ports(_container(moved))
    assert host == [{"name": "gossip-udp", "containerPort": 7950, "hostPort": 7950, "protocol": "UDP"},
                    {"name": "gossip-tcp", "containerPort": 7950, "hostPort": 7950, "protocol": "TCP"}]
    (service,) = _docs("gossip-service.yaml", moved)
    assert [(p["port"], p["targetPort"], p["protocol"]) for p in service["spec"]["ports"]] == [
        (7950, "gossip-udp", "UDP"), (7950, "gossip-tcp", "TCP")]


@pytest.mark.parametrize(("host_network", "field"), [(False, "status.podIP"), (True, "status.hostIP")])
def test_the_advertised_address_comes_from_the_downward_api(host_network: bool, field: str) -> None:
    values = _values(hostNetwork=host_network, secrets=_token())
    for container in ("agent", "health"):
        sidecar = {**values["healthSidecar"], "enabled": True}
        env = _env(_container({**values, "healthSidecar": sidecar}, container))
        assert env["REGION_AGENT_GOSSIP__ADVERTISE_ADDRESS"] == {"fieldRef": {"fieldPath": field}}


def test_the_headless_service_is_every_agent_ready_or_not_and_the_seeds_dns() -> None:
    values = _values()
    (service,) = _docs("gossip-service.yaml", values)
    (daemonset,) = _docs("daemonset.yaml", values)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == daemonset["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {p["name"] for p in _gossip_ports(
        _container(values))}
    name = service["metadata"]["name"]
    assert _env(_container(values))["REGION_AGENT_GOSSIP__SEEDS_DNS"] == f"{name}.dns.svc.cluster.local"

    own = _values()
    own["config"]["gossip"]["seeds_dns"] = "agents.example.internal"
    assert "REGION_AGENT_GOSSIP__SEEDS_DNS" not in _env(_container(own))  # config's name is used
    off = _values()
    off["gossip"]["headlessService"] = False
    assert _docs("gossip-service.yaml", off) == []
    assert "REGION_AGENT_GOSSIP__SEEDS_DNS" not in _env(_container(off))


def test_secrets_are_whole_read_only_volumes_only_in_the_agent_container() -> None:
    """No subPath: the kubelet updates a Secret volume in place, and the agent re-reads the files."""
    values = _values(tls="gossip-tls", healthSidecar={**_plain()["healthSidecar"], "enabled": True},
                     secrets=_token())
    agent = _container(values)
    mounts = {m["name"]: m for m in agent["volumeMounts"] if m["name"].startswith("gossip")}
    assert set(mounts) == {"gossip-keyring", "gossip-tls"}
    assert all(m["readOnly"] is True and "subPath" not in m for m in mounts.values())
    volumes = {v["name"]: v for v in _pod(values)["volumes"] if v["name"].startswith("gossip")}
    assert {n: (v["secret"]["secretName"], v["secret"]["defaultMode"]) for n, v in volumes.items()} == {
        "gossip-keyring": ("gossip-keyring", 0o440), "gossip-tls": ("gossip-tls", 0o440)}
    env = _env(agent)
    files = {"REGION_AGENT_GOSSIP__KEYRING_FILE": ("gossip-keyring", "keyring.json"),
             "REGION_AGENT_GOSSIP__TLS_CA_FILE": ("gossip-tls", "ca.pem"),
             "REGION_AGENT_GOSSIP__TLS_CERT_FILE": ("gossip-tls", "agent.pem"),
             "REGION_AGENT_GOSSIP__TLS_KEY_FILE": ("gossip-tls", "agent-key.pem")}
    for variable, (volume, key) in files.items():
        assert env[variable] == f"{mounts[volume]['mountPath']}/{key}"
    health = _container(values, "health")
    assert not [m for m in health["volumeMounts"] if m["name"].startswith("gossip")]
    assert _env(health)["REGION_AGENT_GOSSIP__KEYRING_FILE"] == env["REGION_AGENT_GOSSIP__KEYRING_FILE"]

    lab = _values(tls="")
    lab["config"]["gossip"]["allow_unsigned"] = True
    without_tls = _env(_container(lab))
    assert "REGION_AGENT_GOSSIP__KEYRING_FILE" in without_tls
    assert not [name for name in without_tls if "TLS" in name]


def test_gossip_without_an_identity_fails_the_install_unless_a_lab_says_so() -> None:
    with pytest.raises(TemplateFailError, match=r"gossip\.tls\.existingSecret"):
        _docs("daemonset.yaml", _values(tls=""))


def test_gossip_without_a_keyring_secret_fails_the_install() -> None:
    with pytest.raises(TemplateFailError, match=r"gossip\.keyring\.existingSecret"):
        _docs("daemonset.yaml", _values(keyring=""))
    errors = _schema_errors(_values(keyring=""))
    assert [e.split(": ")[0] for e in errors] == ["gossip/keyring/existingSecret"], errors


def test_the_network_policy_lets_other_regions_reach_gossip() -> None:
    values = _values(networkPolicy={**_plain()["networkPolicy"], "enabled": True})
    (policy,) = _docs("networkpolicy.yaml", values)
    open_rules = [rule for rule in policy["spec"]["ingress"] if "from" not in rule]
    opened = {(p["port"], p["protocol"]) for rule in open_rules for p in rule["ports"]}
    assert {("gossip-udp", "UDP"), ("gossip-tcp", "TCP")} <= opened


# --- the agent takes what the chart gives ------------------------------------------------------


def test_the_agent_accepts_the_rendered_config_and_environment(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    values = _values(tls="gossip-tls")
    (configmap,) = _docs("configmap.yaml", values)
    config = tmp_path / "agent.yaml"
    config.write_text(configmap["data"]["agent.yaml"])
    for name in list(os.environ):
        if name.startswith("REGION_AGENT_"):
            monkeypatch.delenv(name)
    downward = {"spec.nodeName": "node-a", "status.podIP": "10.1.2.3", "status.hostIP": "192.0.2.3"}
    for name, value in _env(_container(values)).items():
        monkeypatch.setenv(name, value if isinstance(value, str) else downward[value["fieldRef"]["fieldPath"]])
    monkeypatch.setenv("REGION_AGENT_CONFIG", str(config))  # load_settings sets it; monkeypatch then unsets it
    settings = load_settings(config)
    gossip = settings.gossip
    assert gossip.enabled and gossip.port == 7946
    assert gossip.advertise_address == "10.1.2.3"
    assert gossip.seeds == ["198.51.100.21", "[2001:db8::7]:7946"]
    assert gossip.seeds_dns == "ra-region-agent-gossip.dns.svc.cluster.local"
    assert str(gossip.keyring_file) == "/var/run/secrets/region-agent/gossip-keyring/keyring.json"
    assert (str(gossip.tls_ca_file), str(gossip.tls_cert_file), str(gossip.tls_key_file)) == (
        "/var/run/secrets/region-agent/gossip-tls/ca.pem", "/var/run/secrets/region-agent/gossip-tls/agent.pem",
        "/var/run/secrets/region-agent/gossip-tls/agent-key.pem")
    assert gossip.seed_list() == [("198.51.100.21", 7946), ("2001:db8::7", 7946)]


# --- the values schema -------------------------------------------------------------------------


def _with(values: dict[str, Any], value: Any, *path: str) -> dict[str, Any]:
    out = copy.deepcopy(values)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


BAD = [
    ("gossip port 0", (0, "config", "gossip", "port"), "config/gossip/port"),
    ("gossip port over 65535", (70000, "config", "gossip", "port"), "config/gossip/port"),
    ("seeds as one string", ("198.51.100.21", "config", "gossip", "seeds"), "config/gossip/seeds"),
    ("an unknown preset", ("moon", "config", "gossip", "preset"), "config/gossip/preset"),
    ("an empty keyring key", ("", "gossip", "keyring", "key"), "gossip/keyring/key"),
    ("a keyring key with a slash", ("../keyring.json", "gossip", "keyring", "key"), "gossip/keyring/key"),
    ("an empty certificate key", ("", "gossip", "tls", "cert"), "gossip/tls/cert"),
    ("a cluster domain with capitals", ("Cluster.Local", "gossip", "clusterDomain"), "gossip/clusterDomain"),
    ("headlessService as a string", ("yes", "gossip", "headlessService"), "gossip/headlessService"),
    ("an unknown gossip value", (1, "gossip", "seedz"), "gossip"),
]


@pytest.mark.parametrize(("change", "where"), [(c, w) for _n, c, w in BAD], ids=[n for n, _c, _w in BAD])
def test_bad_gossip_values_are_rejected_where_they_are(change: tuple[Any, ...], where: str) -> None:
    errors = _schema_errors(_with(_values(), *change))
    assert [e.split(": ")[0] for e in errors] == [where], errors


def test_cluster_values_validate() -> None:
    assert _schema_errors(_values()) == []
    assert _schema_errors(_values(tls="gossip-tls", hostNetwork=True)) == []
    assert _schema_errors(_values(gossip=False, keyring="")) == []  # a lone agent needs no keyring
