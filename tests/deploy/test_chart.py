"""The Helm chart without helm: its values schema, and that its `config` is exactly the agent's settings."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import BaseModel, ValidationError

from region_agent.app.settings import AgentSettings
from tests.deploy.config_schema import config_schema

CHART = Path(__file__).resolve().parents[2] / "helm" / "region-agent"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
INSTALL = yaml.safe_load((CHART / "ci" / "test-values.yaml").read_text())


def _merge(base: Any, override: Any) -> Any:
    """What Helm does with `-f` files: maps merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = _merge(base.get(key), value) if key in base else value
        return out
    return copy.deepcopy(override)


def _installed() -> dict[str, Any]:
    values: dict[str, Any] = _merge(VALUES, INSTALL)
    return values


def _errors(values: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return sorted("/".join(map(str, e.absolute_path)) + ": " + e.message for e in validator.iter_errors(values))


def _settings(config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> AgentSettings:
    """The settings the agent builds from this agent.yaml, with no environment in the way."""
    import os

    for name in list(os.environ):
        if name.startswith("REGION_AGENT_"):
            monkeypatch.delenv(name)
    return AgentSettings(**config)


def test_the_schema_is_draft_7() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"


def test_values_with_a_region_and_a_zone_validate() -> None:
    assert _errors(_installed()) == []


def test_values_yaml_alone_names_what_an_install_must_set() -> None:
    """No default region or zone: an install without them fails on both, by name."""
    errors = _errors(VALUES)
    assert [e.split(":")[0] for e in errors] == ["config/dns/zone", "config/region"], errors


def _without(values: dict[str, Any], *path: str) -> dict[str, Any]:
    out = copy.deepcopy(values)
    node = out
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return out


def _with(values: dict[str, Any], value: Any, *path: str) -> dict[str, Any]:
    out = copy.deepcopy(values)
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return out


BAD_CONFIG = [
    ("region upper case", lambda v: _with(v, "SFO1", "config", "region"), "config/region"),
    ("region without a number", lambda v: _with(v, "sfo", "config", "region"), "config/region"),
    ("region with a dash", lambda v: _with(v, "us-west1", "config", "region"), "config/region"),
    ("no region", lambda v: _without(v, "config", "region"), "config"),
    ("no zone", lambda v: _without(v, "config", "dns", "zone"), "config/dns"),
    ("no dns at all", lambda v: _without(v, "config", "dns"), "config"),
    ("a setting that does not exist", lambda v: _with(v, 1, "config", "dns", "portt"), "config/dns"),
    ("a group that does not exist", lambda v: _with(v, {"a": 1}, "config", "gossipp"), "config"),
    ("a port out of range", lambda v: _with(v, 70000, "config", "dns", "port"), "config/dns/port"),
    ("a string for a number", lambda v: _with(v, "soon", "config", "shutdown_drain_seconds"),
     "config/shutdown_drain_seconds"),
    ("a negative drain", lambda v: _with(v, -1, "config", "shutdown_drain_seconds"), "config/shutdown_drain_seconds"),
    ("an unknown health mode", lambda v: _with(v, "both", "config", "health", "mode"), "config/health/mode"),
]

BAD_CHART = [
    ("maxUnavailable 0", lambda v: _with(v, 0, "updateStrategy", "maxUnavailable"), "updateStrategy/maxUnavailable"),
    ("a pull policy that does not exist", lambda v: _with(v, "Sometimes", "image", "pullPolicy"), "image/pullPolicy"),
    ("a relative spool path", lambda v: _with(v, "var/lib", "usageSpool", "hostPath"), "usageSpool/hostPath"),
    ("an unknown top-level key", lambda v: _with(v, True, "hostNetwrok"), ""),
    ("a traffic policy that does not exist", lambda v: _with(v, "Nearest", "services", "dns", "externalTrafficPolicy"),
     "services/dns/externalTrafficPolicy"),
    ("a secret without its key", lambda v: _without(v, "secrets", "tsigKeys", "key"), "secrets/tsigKeys"),
]


@pytest.mark.parametrize(("change", "where"), [(c, w) for _n, c, w in BAD_CONFIG + BAD_CHART],
                         ids=[n for n, _c, _w in BAD_CONFIG + BAD_CHART])
def test_bad_values_are_rejected_where_they_are(change: Any, where: str) -> None:
    errors = _errors(change(_installed()))
    assert errors, "accepted"
    assert [e.split(": ")[0] for e in errors] == [where], errors


@pytest.mark.parametrize("change", [c for _n, c, _w in BAD_CONFIG if _n not in ("no region", "no zone",
                                                                                 "no dns at all")],
                         ids=[n for n, _c, _w in BAD_CONFIG if n not in ("no region", "no zone", "no dns at all")])
def test_the_agent_refuses_what_the_schema_refuses(change: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The schema is not stricter than the agent about a value (missing region/zone are the chart's own rule)."""
    with pytest.raises(ValidationError):
        _settings(change(_installed())["config"], monkeypatch)


# --- every settings field is a config value, and every config value a settings field ------------


def _settings_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _settings_paths(annotation, f"{prefix}{name}.")
        else:
            yield prefix + name


def _schema_paths(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for name, sub in node["properties"].items():
        if sub.get("type") == "object" and "properties" in sub:
            yield from _schema_paths(sub, f"{prefix}{name}.")
        else:
            yield prefix + name


def _value_paths(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for name, sub in node.items():
        if isinstance(sub, dict) and sub:
            yield from _value_paths(sub, f"{prefix}{name}.")
        else:
            yield prefix + name


def test_the_schema_config_is_exactly_the_settings() -> None:
    settings = set(_settings_paths(AgentSettings))
    schema = set(_schema_paths(SCHEMA["properties"]["config"]))
    assert len(settings) > 100
    assert settings - schema == set(), "settings the chart can not set"
    assert schema - settings == set(), "config values the agent does not have"


def test_the_schema_config_is_generated_from_the_current_settings() -> None:
    """Types, bounds and descriptions too: after a settings change, `python -m tests.deploy.config_schema --write`."""
    assert SCHEMA["properties"]["config"] == config_schema()


def test_every_config_value_in_values_yaml_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _installed()["config"]
    assert set(_value_paths(config)) <= set(_settings_paths(AgentSettings))
    settings = _settings(config, monkeypatch)
    assert (settings.region, settings.dns.zone, settings.kubernetes) == ("sfo1", "g.example.com", True)
    assert settings.shutdown_drain_seconds == config["shutdown_drain_seconds"]
    assert settings.usage.spool_path == config["usage"]["spool_path"]


# --- values.yaml is documented; RBAC is exactly what the agent reads ------------------------------

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w.-]*):(?P<rest>.*)$")


def test_every_value_is_documented() -> None:
    """Each key with a value (not a block of keys) has a comment right above it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        match = _KEY.match(line)
        if not match or not match["rest"].strip() or match["rest"].strip().startswith("#"):
            continue
        above = [x for x in lines[:i] if x.strip()][-1].strip()
        if not above.startswith("#"):
            undocumented.append(f"{i + 1}: {line.strip()}")
    assert undocumented == []


def _static_yaml(template: Path) -> list[dict[str, Any]]:
    """A template whose Helm actions are only conditionals and scalars, as YAML (actions blanked)."""
    text = "\n".join(line for line in template.read_text().splitlines() if not line.strip().startswith("{{-"))
    text = re.sub(r"\{\{.*?\}\}", "x", text)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_rbac_grants_exactly_read_of_what_the_agent_watches() -> None:
    role = next(d for d in _static_yaml(CHART / "templates" / "clusterrole.yaml") if d["kind"] == "ClusterRole")
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    expected = {(group, resource, verb) for group, resource in [("serving.knative.dev", "services"), ("", "pods"),
                                                                 ("postgresql.cnpg.io", "clusters")]
                for verb in ("get", "list", "watch")}
    assert granted == expected
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])  # no resourceNames tricks
