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
    operator_listen_addresses: tuple[str, ...] = Field(
        default=("127.0.0.1",),
        description=(
            "IP literals of the operator listener (/metrics, /zone, verbose /health/region and "
            "/global-health). Loopback by default: on a hostNetwork node anything else is the node's "
            "network. To let Prometheus or the kubelet reach it, listen on the pod address (or "
            "0.0.0.0) and set `operator_token_file`; /livez and /readyz stay open for probes."
        ),
    )
    operator_port: int = Field(
        default=8087,
        ge=0,
        le=65535,
        description=(
            "TCP port of the agent's operator listener, in both modes (the agent always serves it; "
            "the public listener on `port` runs in the agent or in the sidecar). 0 picks a free one."
        ),
    )
    sidecar_operator_port: int = Field(
        default=8088,
        ge=0,
        le=65535,
        description=(
            "Sidecar mode: the sidecar's own operator listener (its /metrics: feed and request "
            "metrics), on `operator_listen_addresses`; it shares the pod's network with the agent, "
            "so it needs a port of its own. 0 picks a free one."
        ),
    )
    operator_token_file: Path | None = Field(
        default=None,
        description=(
            "File holding a bearer token the operator listener requires (`Authorization: Bearer "
            "<token>`, compared in constant time; 401 otherwise), except on /livez and /readyz. "
            "Re-read when the file changes (a rotated Kubernetes Secret). None: no token (fine on "
            "loopback only)."
        ),
    )
    metrics_cache_seconds: float = Field(
        default=1.0,
        ge=0,
        description=(
            "/metrics is rendered at most once per this many seconds, whoever asks: N scrapers cost "
            "one render. Rendering thousands of series takes milliseconds of the agent's loop, so 0 "
            "(every scrape renders) lets scrapers slow DNS answers; longer serves older numbers."
        ),
    )
    header_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        description=(
            "A request's line, headers (and body, if any) must arrive within this from its first byte, "
            "or the connection is closed (slowloris). Monitors send a request in one packet; longer "
            "only helps a client on a very slow link."
        ),
    )
    idle_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description=(
            "An open connection with no request is closed after this long (from connect, or from the "
            "end of the previous answer). aiohttp's default is an hour; every idle connection holds a "
            "descriptor. Shorter than a client's own keep-alive makes that client reconnect."
        ),
    )
    max_connections: int = Field(
        default=256,
        ge=1,
        description=(
            "Open connections per listener. A new connection beyond it closes the connection that "
            "has been quiet longest (as Knot and NSD do with DNS over TCP), so connections held by "
            "a flood can not lock out monitors. Keep the sum of both listeners' caps well under the "
            "process's descriptor limit (`ulimit -n`): a warning at start says when it is not."
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

    @field_validator("listen_addresses", "operator_listen_addresses")
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

    @field_validator("operator_token_file")
    @classmethod
    def _token_file_usable(cls, value: Path | None) -> Path | None:
        # Checked at start so a bad path stops start-up naming the setting; re-read at run time.
        if value is not None:
            try:
                token = value.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ValueError(f"{value}: {exc.strerror}") from exc
            if not token:
                raise ValueError(f"{value} is empty")
        return value

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
