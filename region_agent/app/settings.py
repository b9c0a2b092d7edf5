"""The agent's settings: one validated model composed of each component's settings.

Sources, strongest first: keyword arguments (the CLI), environment variables
(``REGION_AGENT_<FIELD>``, nested groups with ``__`` as in ``REGION_AGENT_DNS__PORT=5353``),
a YAML file (``--config`` or ``REGION_AGENT_CONFIG``), then the defaults. Anything invalid
stops start-up with :class:`SettingsError`, whose message names every bad field.
"""

from __future__ import annotations

import difflib
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings import SettingsError as PydanticSettingsError

from region_agent.app.listeners import conflicts, planned_listeners
from region_agent.base.names import region_name
from region_agent.checks.settings import ChecksSettings
from region_agent.cluster.settings import ClusterSettings
from region_agent.globaldns.geoip.source import GeoipSettings
from region_agent.globaldns.reachability import ReachabilitySettings
from region_agent.globaldns.settings import DnsSettings
from region_agent.gossip.settings import GossipSettings
from region_agent.health.settings import HealthSettings
from region_agent.kube.settings import KubeSettings
from region_agent.usage.settings import UsageSettings

CONFIG_ENV = "REGION_AGENT_CONFIG"
ENV_PREFIX = "REGION_AGENT_"
# REGION_AGENT_* variables the project reads that are not settings: the settings file (``--config``),
# the e2e alert recording switch (tests/e2e/test_alert_recordings.py), the image test's base cache.
NON_SETTINGS_ENV = frozenset((CONFIG_ENV, "REGION_AGENT_RECORD", "REGION_AGENT_IMAGE_CACHE"))


class SettingsError(ValueError):
    """Settings that can not be used; the message is meant for the operator."""


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid",
                                      frozen=True)

    region: str = Field(default="lcl1", description="This agent's region, IATA code + number (sfo1).")
    node: str = Field(default_factory=socket.gethostname,
                      description="Node (host) name; part of this agent's writer id and usage records.")
    zone_file: Path | None = Field(
        default=None,
        description="Standalone mode: a YAML file with the regions and projects of the zone, re-read on "
        "SIGHUP or when it changes. A bad file keeps the zone being served and is logged and counted.",
    )
    zone_file_poll_interval: float = Field(default=2.0, gt=0, description="Seconds between zone file checks.")
    zone_file_settle: float = Field(
        default=0.5, ge=0,
        description="A changed zone file is applied once two reads this many seconds apart agree (same size, "
        "mtime and hash), so a file caught mid-write is never served.")
    zone_file_max_bytes: int = Field(
        default=1 << 20, gt=0,
        description="A larger zone file is refused (the default, 1 MiB, is what a Kubernetes ConfigMap holds).")
    zone_file_allow_mass_removal: bool = Field(
        default=False,
        description="Apply a zone file that removes more than half of the projects at once. Without it such a "
        "file is refused and logged with the counts; to confirm one, set this in the settings file and send "
        "SIGHUP (it is re-read on every zone file read), then unset it.")
    kubernetes: bool = Field(
        default=False,
        description="Watch this region's Knative Services (and CloudNativePG clusters) and serve "
        "/global-health/<slug> from them.",
    )
    log_level: str = Field(default="info", description="debug, info, warning or error.")
    shutdown_budget: float = Field(
        default=15.0, gt=0,
        description="Seconds a graceful stop may take (usage checkpoints open sessions; keep it below the "
        "pod's terminationGracePeriodSeconds, 30 by default).",
    )
    shutdown_drain_seconds: float = Field(
        default=5.0, ge=0,
        description="On SIGTERM, seconds the agent keeps answering DNS and health while /readyz says 503 "
        "`draining`, so load balancers drop it before it stops (a second SIGTERM ends the drain early). Keep "
        "drain + shutdown_budget below the pod's terminationGracePeriodSeconds; 0 stops at once.",
    )
    dns: DnsSettings = Field(default_factory=DnsSettings)
    checks: ChecksSettings = Field(default_factory=ChecksSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    kube: KubeSettings = Field(default_factory=KubeSettings)
    usage: UsageSettings = Field(default_factory=UsageSettings)
    reachability: ReachabilitySettings = Field(default_factory=ReachabilitySettings)
    gossip: GossipSettings = Field(default_factory=GossipSettings)
    state_file: Path | None = Field(
        default=None,
        description="Cluster mode: where this agent keeps a snapshot of the replicated store, loaded at start so "
        "projects and regions written through the control API survive a restart of every agent at once. "
        "Unset: the store lives in memory only (peers refill it).")
    state_file_interval: float = Field(
        default=30.0, gt=0, description="Seconds between two snapshots while the store changes (and one at stop).")
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)

    @field_validator("region")
    @classmethod
    def _region(cls, value: str) -> str:
        return region_name(value)

    @model_validator(mode="after")
    def _witness_needs_gossip(self) -> AgentSettings:
        if self.cluster.role == "witness" and not self.gossip.enabled:
            raise ValueError("cluster.role witness needs gossip.enabled: a witness only votes in a cluster")
        return self

    @model_validator(mode="after")
    def _listeners_apart(self) -> AgentSettings:
        found = conflicts(planned_listeners(self))
        if found:
            more = f" (and {len(found) - 1} more conflicts)" if len(found) > 1 else ""
            raise ValueError(f"listener conflict: {found[0]}{more}")
        return self

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.lower() not in {"debug", "info", "warning", "error"}:
            raise ValueError("must be debug, info, warning or error")
        return value.lower()

    @property
    def writer_id(self) -> str:
        # With a zone file and no gossip this agent is the whole system (it writes every key);
        # in a cluster it writes as its region (copy health), and a zone file is imported as control.
        scope = "standalone" if self.zone_file is not None and not self.gossip.enabled else self.region
        return f"{scope}/{self.node}"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlSource(settings_cls)


class _YamlSource(PydanticBaseSettingsSource):
    """The YAML file named by ``REGION_AGENT_CONFIG`` (set by ``--config``)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get(CONFIG_ENV)
        if not path:
            return {}
        try:
            with open(path, encoding="utf-8") as handle:
                data = yaml.safe_load(handle)
        except OSError as exc:
            raise SettingsError(f"config file {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise SettingsError(f"config file {path}: not UTF-8 (byte {exc.start})") from None
        except yaml.YAMLError as exc:
            raise SettingsError(f"config file {path}: not valid YAML: {exc}") from exc
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise SettingsError(f"config file {path}: must be a mapping of settings")
        base = Path(path).resolve().parent
        if isinstance(data.get("zone_file"), str):
            data["zone_file"] = str(base / data["zone_file"])  # relative to the config file
        return data


def load_settings(config: Path | None = None, **overrides: Any) -> AgentSettings:
    """Build the settings or raise :class:`SettingsError` naming every bad field."""
    if config is not None:
        os.environ[CONFIG_ENV] = str(config)
    try:
        return AgentSettings(**overrides)
    except PydanticSettingsError as exc:  # an environment value that is not JSON where JSON is due
        raise SettingsError(f"invalid settings: {exc}: {_env_hint(str(exc))}") from None
    except ValidationError as exc:
        lines = [_error_line(error) for error in exc.errors()]
        if len(lines) == 1:  # one problem, one line
            raise SettingsError(f"invalid settings: {lines[0]}") from None
        raise SettingsError("invalid settings:\n" + "\n".join(f"  {line}" for line in lines)) from None


def settings_env_names(model: type[BaseModel] = AgentSettings, prefix: str = ENV_PREFIX) -> list[str]:
    """Every environment variable that sets a field: a group (JSON) and each field below it (``__``)."""
    names = []
    for name, field in model.model_fields.items():
        names.append(f"{prefix}{name.upper()}")
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            names.extend(settings_env_names(field.annotation, f"{prefix}{name.upper()}__"))
    return names


def unknown_env_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per ``REGION_AGENT_*`` variable that is no setting (pydantic-settings ignores it
    silently, so a typo would otherwise go unnoticed), with the closest setting when there is one."""
    environ = os.environ if environ is None else environ
    known = set(settings_env_names())
    lines = []
    for name in sorted(environ):
        upper = name.upper()  # the settings read the environment case-insensitively
        if upper.startswith(ENV_PREFIX) and upper not in known and upper not in NON_SETTINGS_ENV:
            lines.append(f"environment variable {name} is not a setting, ignored{_did_you_mean(upper)}")
    return lines


def _did_you_mean(name: str) -> str:
    suffixes = [known.removeprefix(ENV_PREFIX) for known in settings_env_names()]
    close = difflib.get_close_matches(name.upper().removeprefix(ENV_PREFIX), suffixes, n=1, cutoff=0.75)
    return f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""


def _error_line(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "settings"
    line = f"{where}: {error['msg']}"
    if error.get("type") == "extra_forbidden":  # a typo in a group's field: name the variable behind it
        env = ENV_PREFIX + "__".join(str(part) for part in error["loc"]).upper()
        for name in (n for n in os.environ if n.upper() == env):
            line += f" (from {name}{_did_you_mean(name)})"
    return line


def reread_geoip_settings() -> tuple[GeoipSettings, Path | None]:
    """The GeoIP settings as the settings file says now (called off the loop, so a changed
    source needs no restart)."""
    dns = load_settings().dns
    return dns.geoip, dns.geoip_database


def mass_removal_allowed(settings: AgentSettings) -> Callable[[], bool]:
    """Whether the zone file may remove most projects, as the settings file says at each read
    (called off the loop), so an operator confirms a refused mass removal by setting it and
    sending SIGHUP."""
    def allowed() -> bool:
        if settings.zone_file_allow_mass_removal:
            return True
        try:
            return load_settings().zone_file_allow_mass_removal
        except SettingsError:
            return False
    return allowed


def _env_hint(message: str) -> str:
    """Name the environment variables behind a field pydantic-settings could not parse."""
    field = message.split('"')[1] if message.count('"') >= 2 else ""
    prefix = f"REGION_AGENT_{field.upper()}"
    names = sorted(n for n in os.environ if n == prefix or n.startswith(prefix + "__"))
    shown = ", ".join(f"{n}={os.environ[n]!r}" for n in names) or "see the REGION_AGENT_* variables"
    return f"{shown}; lists and mappings are written as JSON, e.g. REGION_AGENT_DNS__LISTEN_ADDRESSES='[\"127.0.0.1\"]'"
