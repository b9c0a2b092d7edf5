"""Settings of the health listener and its feed, with the trade-off of every value.

A plain pydantic ``BaseModel``: the agent composes it into its own settings, so the
environment variables are ``REGION_AGENT_HEALTH__<FIELD>`` (for example
``REGION_AGENT_HEALTH__STALE_AFTER_SECONDS=10``). Validation happens once at start and every
error names the field.
"""

from __future__ import annotations

import enum
import ipaddress
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["HealthMode", "HealthSettings"]


class HealthMode(enum.StrEnum):
    """Where the listener runs."""

    IN_PROCESS = "in-process"  # inside `region-agent run`, fed directly
    SIDECAR = "sidecar"  # in `region-agent health`, fed over the Unix socket


class HealthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: HealthMode = Field(
        default=HealthMode.IN_PROCESS,
        description=(
            "in-process: `region-agent run` serves port 8086 itself (one process, nothing to "
            "deploy, but a DNS flood on the agent's event loop also slows health answers). "
            "sidecar: the agent only publishes its view on `feed_socket` and a separate "
            "`region-agent health` container answers, on its own core; its answers turn to "
            "503 `stale` when the agent stops feeding it."
        ),
    )
    listen_addresses: tuple[str, ...] = Field(
        default=("0.0.0.0", "::"),
        description=(
            "IP literals to listen on, one socket each (IPv6 sockets are v6-only, so 0.0.0.0 "
            "and :: can share the port). An address whose family the host lacks (IPv6 "
            "disabled in the pod) is skipped with a warning unless `require_all_addresses`."
        ),
    )
    port: int = Field(
        default=8086,
        ge=0,
        le=65535,
        description="TCP port of the listener; 0 picks a free one (tests, benches).",
    )
    agent_port: int = Field(
        default=8087,
        ge=0,
        le=65535,
        description=(
            "Sidecar mode only: the agent's own listener (/metrics with the DNS metrics, /readyz, "
            "/livez, /zone), since the sidecar owns `port`. In-process mode serves all of it on `port`."
        ),
    )
    require_all_addresses: bool = Field(
        default=False,
        description=(
            "Fail at start when any listen address can not be bound. Off by default so that a "
            "single-stack pod still starts; an address already in use always fails."
        ),
    )
    feed_socket: Path = Field(
        default=Path("/run/region-agent/health.sock"),
        description=(
            "Unix socket the agent publishes its view on and the sidecar reads (an emptyDir "
            "shared by both containers). Used only in sidecar mode."
        ),
    )
    stale_after_seconds: float = Field(
        default=15.0,
        gt=0,
        description=(
            "Sidecar: once the agent has not vouched for the held view for this long, every "
            "project answers 503 `stale`. Shorter takes a hung agent out of the answers sooner; "
            "longer rides out a slower agent restart (its first full LIST must finish within "
            "the bound, or answers go `stale` meanwhile)."
        ),
    )
    heartbeat_interval_seconds: float = Field(
        default=1.0,
        gt=0,
        description=(
            "How often the agent tells the sidecar it is alive when nothing changed. Must be "
            "well under `stale_after_seconds` (at most a third) so that one late heartbeat "
            "never makes answers flap; each costs one tiny line on a local socket."
        ),
    )
    feed_min_interval_seconds: float = Field(
        default=0.2,
        ge=0,
        description=(
            "Changes are coalesced: the agent encodes and sends the full view at most once per "
            "interval (latest wins). Encoding 10,000 copies takes tens of milliseconds of the "
            "agent's loop, so 0 would let a burst of watch events eat the agent's core; longer "
            "delays the sidecar's answers by up to this much."
        ),
    )
    feed_max_line_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description=(
            "Largest feed message the sidecar accepts (and the most the agent buffers for a slow "
            "sidecar before dropping its connection). 10,000 copies encode to about 2 MB."
        ),
    )
    feed_reconnect_max_seconds: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Cap of the sidecar's jittered reconnect backoff. Must stay well under "
            "`stale_after_seconds` so a restarted agent is heard again before answers go stale."
        ),
    )
    degraded_lag_seconds: float = Field(
        default=30.0,
        gt=0,
        description=(
            "/health/region reports degraded when a data binding's replay lag exceeds this. "
            "Lower warns earlier but flags ordinary write bursts."
        ),
    )
    request_log_per_second: float = Field(
        default=20.0,
        ge=0,
        description=(
            "Request log lines per second (token bucket, burst of the same size). Only answers "
            "other than 2xx are logged at info (every request at debug level); at 15,000 "
            "requests/s a line per request would cost more than the answers. Lines dropped by "
            "the limit are counted in the next line's `suppressed` and in a metric. 0 disables."
        ),
    )

    @field_validator("listen_addresses")
    @classmethod
    def _ip_literals(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("needs at least one address")
        out: list[str] = []
        for raw in value:
            try:
                out.append(str(ipaddress.ip_address(raw)))
            except ValueError as exc:
                raise ValueError(f"{raw!r} is not an IP address literal") from exc
        return tuple(dict.fromkeys(out))

    @field_validator("feed_socket")
    @classmethod
    def _fits_sun_path(cls, value: Path) -> Path:
        if len(str(value).encode()) > 107:
            raise ValueError(f"{value} is longer than a Unix socket path may be (107 bytes)")
        return value

    @model_validator(mode="after")
    def _intervals_fit_the_bound(self) -> HealthSettings:
        if self.heartbeat_interval_seconds * 3 > self.stale_after_seconds:
            raise ValueError(
                f"heartbeat_interval_seconds ({self.heartbeat_interval_seconds}) must be at most a third "
                f"of stale_after_seconds ({self.stale_after_seconds}), or one late heartbeat flaps answers"
            )
        if self.feed_reconnect_max_seconds * 3 > self.stale_after_seconds:
            raise ValueError(
                f"feed_reconnect_max_seconds ({self.feed_reconnect_max_seconds}) must be at most a third "
                f"of stale_after_seconds ({self.stale_after_seconds}), or an agent restart flaps answers"
            )
        return self
