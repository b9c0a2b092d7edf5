"""Settings of usage metering: which pods, where the spool lives, where and how records are reported.

The lead composes ``UsageSettings`` into the agent settings as the ``usage`` group, so every field
reads ``REGION_AGENT_USAGE__<FIELD>`` from the environment. Every field says what it trades off;
billing correctness never depends on a setting (they move cost, latency and crash exposure, not
whether a second is billed once).
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

SERVICE_LABEL = "serving.knative.dev/service"
REVISION_LABEL = "serving.knative.dev/revision"
MIN_SCALE_ANNOTATIONS = ("autoscaling.knative.dev/min-scale", "autoscaling.knative.dev/minScale")


class UsageSettings(BaseModel):
    """Usage sessions of the project pods on this node (DESIGN.md item 6, issue 4)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        True,
        description="Meter the project pods on this node. Off: no pod watch, no spool, nothing reported "
        "(use only where another system bills; usage of the time it is off is never recovered).",
    )
    spool_path: str = Field(
        "/var/lib/region-agent/usage.sqlite3",
        description="SQLite spool file (WAL mode; `-wal` and `-shm` files live beside it). Must be on a "
        "volume that survives a container restart (hostPath or a local PV): sessions and unsent records "
        "live only here until the control plane acknowledges them. Never wipe it while records are unsent.",
    )
    journal_size: int = Field(
        20_000, ge=100,
        description="Pod events kept in memory while the spool can not be opened or written (a bad volume), "
        "applied in order once it can. Each is a few hundred bytes. Beyond it further events are dropped "
        "(counted, logged at error level) and the agent reconciles with the pod list once the spool is "
        "back: running pods lose nothing, but a pod that started and was deleted in the dropped window is "
        "not billed. 20,000 is about 15 minutes of a node churning 1,000 pods a minute.",
    )
    spool_retry_initial: float = Field(
        0.5, gt=0,
        description="First delay ceiling (seconds, full jitter) before opening the spool again after it "
        "could not be opened or written; doubles up to `spool_retry_cap`.",
    )
    spool_retry_cap: float = Field(
        30.0, gt=0,
        description="Largest delay ceiling between attempts to open the spool (seconds): how long after a "
        "volume is fixed the agent notices at most.",
    )
    checkpoint_interval: float = Field(
        60.0, gt=0,
        description="Seconds between checkpoints of open sessions. Each checkpoint cuts one record "
        "(slice) per open session, so a long session is billed progressively and a crash loses at most "
        "this long of an open session whose pod also vanished while the agent was down. Shorter: less "
        "exposure, more records (rows, bytes on the wire) per pod-hour: 3600/interval records per pod-hour.",
    )
    commit_delay: float = Field(
        0.1, ge=0, le=5,
        description="Seconds the service waits after an event before writing, so events that arrive "
        "together share one SQLite transaction (one fsync). Under churn this is most of the agent's CPU "
        "saving; the cost is that changes sit this long in memory. A crash in that window is repaired "
        "by the start-up reconcile from the pods' own timestamps, except the end of a pod that also "
        "vanished in the window, which falls back to its deletion deadline or last checkpoint.",
    )
    endpoint_url: str | None = Field(
        None,
        description="Control-plane usage endpoint, e.g. `https://control.example.com/v1/usage` "
        "(POST, JSON, see region_agent/usage/README.md). None: records are spooled and kept, never sent, "
        "and the spool grows until the bound (use only while the endpoint is being provisioned).",
    )
    token_file: str | None = Field(
        "/var/run/secrets/region-agent/usage/token",
        description="File holding the bearer token for the endpoint (a mounted Secret). Re-read when it "
        "changes, so a rotated token is picked up without a restart. Takes precedence over `token`.",
    )
    token: SecretStr | None = Field(
        None,
        description="Bearer token given inline (development). Prefer `token_file`: env vars leak into "
        "`kubectl describe` and crash dumps more easily than a mounted file.",
    )
    ca_file: str | None = Field(
        None,
        description="CA bundle to verify the endpoint's TLS certificate. None: the system trust store. "
        "Verification is never switched off: the bearer token would go to whoever answers.",
    )
    batch_size: int = Field(
        500, ge=1, le=10_000,
        description="Records per POST. Larger batches cost fewer requests but a rejected batch puts more "
        "records aside for bisection, and a request body grows ~600 bytes per record.",
    )
    report_interval: float = Field(
        2.0, gt=0,
        description="Seconds the reporter waits after a batch that was not full before it sends again. "
        "Longer: fewer, fuller requests; shorter: fresher usage at the control plane. A full batch is "
        "always followed immediately by the next one.",
    )
    request_timeout: float = Field(
        15.0, gt=0,
        description="Seconds allowed for one POST, connect to last response byte. A stalled control plane "
        "is abandoned after this and the same records are retried with the same idempotency keys.",
    )
    backoff_initial: float = Field(
        1.0, gt=0, description="First retry delay ceiling after a failed POST (seconds); full jitter."
    )
    backoff_cap: float = Field(
        60.0, gt=0,
        description="Largest retry delay ceiling (seconds). Bounds how long after a control-plane outage "
        "ends the first record gets through; smaller caps send more requests into a dead endpoint.",
    )
    retry_after_cap: float = Field(
        600.0, gt=0,
        description="Largest Retry-After honoured (seconds). A longer value from a misbehaving proxy is "
        "cut to this so reporting can not stop for hours.",
    )
    retry_statuses: tuple[int, ...] = Field(
        (401, 403, 404, 408, 425, 429),
        description="4xx statuses that are retried like a 5xx instead of putting the batch aside. 401/403 "
        "(token expired or being rotated) and 404 (endpoint not deployed yet) are about the endpoint, not "
        "the batch: quarantining would move every record aside during an auth incident. Any other 4xx "
        "is a verdict on the records and sends them to quarantine.",
    )
    bisect_rejected: bool = Field(
        True,
        description="When a batch of more than one record is rejected with a 4xx, resend it as two halves "
        "until the rejected records are isolated, so one malformed record does not quarantine 499 good "
        "ones. Costs about 2*log2(batch_size) extra requests per bad record.",
    )
    max_spool_bytes: int = Field(
        512 * 1024 * 1024, ge=1024 * 1024,
        description="Size bound of the spool's live data (bytes). Beyond `spool_warn_fraction` of it the "
        "agent logs an error at every checkpoint and `region_agent_usage_spool_bytes` shows it; at the "
        "bound checkpoints stop cutting records (open sessions keep accruing in their one row and are "
        "billed in one larger record later) but closed sessions are still written: data is never dropped, "
        "the bound is exceeded instead. ~600 bytes per record; 512 MiB holds ~10 days of a 1,000-pod node "
        "at the default checkpoint interval without the control plane.",
    )
    spool_warn_fraction: float = Field(
        0.8, gt=0, le=1,
        description="Fraction of `max_spool_bytes` at which the agent starts logging at error level.",
    )
    sent_retention: float = Field(
        3600.0, ge=0,
        description="Seconds an acknowledged record stays in the spool (marked sent) for inspection before "
        "it is deleted. Longer helps answering 'was this sent?' at the cost of spool space.",
    )
    slug_label: str | None = Field(
        "region-agent.io/project",
        description="Pod label holding the project slug (the same label as `kube.slug_label` on the Service; "
        "it reaches pods when it is in the Service's template labels). None, or absent on a pod: the Knative "
        f"Service name (label `{SERVICE_LABEL}`) is the slug, as on the copy-health side. Records also "
        "carry namespace and service, so the control plane can map them itself.",
    )
    service_label: str = Field(
        SERVICE_LABEL,
        description="Label that marks a pod as part of a project copy; the pod watch selects pods that "
        "have it (existence selector). Pods without it are never metered.",
    )
    min_scale_annotations: tuple[str, ...] = Field(
        MIN_SCALE_ANNOTATIONS,
        description="Pod annotations read for the minimum scale, first present wins. A project with "
        "min-scale >= 1 is always-on and priced as such; Knative copies revision annotations to pods.",
    )

    @model_validator(mode="after")
    def _coherent(self) -> Self:
        if self.backoff_cap < self.backoff_initial:
            raise ValueError("usage.backoff_cap must be >= usage.backoff_initial")
        if self.spool_retry_cap < self.spool_retry_initial:
            raise ValueError("usage.spool_retry_cap must be >= usage.spool_retry_initial")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError("usage.endpoint_url must be an http:// or https:// URL")
        return self
