"""Settings of the Kubernetes side: where the API is, what to watch, how patiently.

Grouped by concern (``watch``, ``cnpg``) so the lead composes ``KubeSettings`` into the agent
settings once and each env var reads ``REGION_AGENT_KUBE__<FIELD>`` or
``REGION_AGENT_KUBE__WATCH__<FIELD>``. Every field says what it trades off; the defaults follow
client-go's reflector where one exists (PLATFORM.md §2.3).
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class WatchSettings(BaseModel):
    """Timeouts, backoff and page size of one informer (list + watch loop)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    server_timeout_min: int = Field(
        default=300,
        ge=1,
        description="Lower bound of the random timeoutSeconds sent with each watch (seconds). The apiserver "
        "ends the stream after it and the informer re-watches from its last resourceVersion without "
        "a relist. Shorter: more reconnects; longer: a broken stream that still looks alive lives "
        "longer. client-go: 300.",
    )
    server_timeout_max: int = Field(
        default=600,
        ge=1,
        description="Upper bound of the random watch timeoutSeconds (seconds). Randomising spreads the "
        "reconnects of many agents over time. client-go: 600.",
    )
    read_margin: float = Field(
        default=30.0,
        gt=0,
        description="Seconds added to the watch's timeoutSeconds for the client-side read deadline. A "
        "healthy server ends the stream at timeoutSeconds; one silent past timeoutSeconds + margin "
        "is a half-open connection and is dropped. Too small cuts healthy streams on a slow "
        "network; too large delays detection of a dead connection.",
    )
    connect_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds to open a TCP+TLS connection to the apiserver before the attempt counts as "
        "failed and is retried with backoff.",
    )
    list_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds allowed for one LIST page (request and body). A page of `page_size` objects "
        "normally takes well under a second; the bound only catches stuck connections.",
    )
    page_size: int = Field(
        default=250,
        ge=1,
        le=10_000,
        description="Objects per LIST page (`limit`). Smaller pages cost more round trips (10,000 objects: "
        "40 pages at 250), larger pages more transient memory while a page is parsed, which the "
        "allocator keeps as RSS (bench/kube_list.py: +4 MB at 500 for 4.5 KiB Services). client-go: 500.",
    )
    backoff_initial: float = Field(
        default=0.8,
        gt=0,
        description="First retry delay ceiling after a failed list or watch (seconds); full jitter.",
    )
    backoff_cap: float = Field(
        default=30.0,
        gt=0,
        description="Largest retry delay ceiling (seconds). Bounds how stale the cache can get "
        "after the apiserver comes back.",
    )
    backoff_reset_after: float = Field(
        default=120.0,
        gt=0,
        description="Seconds without a failure after which the backoff starts again from `backoff_initial`.",
    )
    very_short_watch: float = Field(
        default=1.0,
        ge=0,
        description="A watch that ends cleanly faster than this (seconds) without a single event is treated "
        "as an error and backed off, so a misbehaving proxy cannot make the informer spin. client-go: 1 s.",
    )
    max_line_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        description="Largest single watch event accepted (bytes). etcd caps objects near 1.5 MiB; a longer "
        "line means a broken stream and ends the watch.",
    )

    @model_validator(mode="after")
    def _timeouts_ordered(self) -> Self:
        if self.server_timeout_max < self.server_timeout_min:
            raise ValueError("watch.server_timeout_max must be >= watch.server_timeout_min")
        if self.backoff_cap < self.backoff_initial:
            raise ValueError("watch.backoff_cap must be >= watch.backoff_initial")
        return self


class CnpgStatusSettings(BaseModel):
    """How the CloudNativePG instance-manager status of each binding is polled (PLATFORM.md §5.2)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        default=True,
        description="Watch CloudNativePG Clusters and poll their status. Off in regions without CNPG: then "
        "no copy has a data condition. On while the CRD is missing, the Cluster watch never syncs "
        "and every copy answers cache-not-synced.",
    )
    status_port: int = Field(default=8000, ge=1, le=65535, description="Instance-manager status port (`/pg/status`).")
    metrics_port: int | None = Field(
        default=9187,
        ge=1,
        le=65535,
        description="Port of the instance's Prometheus exporter, read for `cnpg_pg_replication_lag` "
        "(seconds). None: lag in seconds is not known, only streaming state and byte backlog.",
    )
    ca_file: str | None = Field(
        default=None,
        description="CA bundle to verify the status endpoint's TLS certificate. None: TLS without "
        "verification; the endpoint serves no secrets, and a spoofed answer can only change this region's "
        "data health. Set it when the pod network is not trusted.",
    )
    poll_interval: float = Field(
        default=5.0,
        gt=0,
        description="Seconds between two polls of one binding. Shorter notices a broken replica sooner at "
        "the cost of one HTTPS request per binding per interval.",
    )
    request_timeout: float = Field(
        default=3.0,
        gt=0,
        description="Seconds allowed for one status (or metrics) request, connect included.",
    )
    grace: float = Field(
        default=20.0,
        ge=0,
        description="Seconds a binding keeps its last good status while polls fail. Longer rides out a "
        "restarting instance manager without a DNS change; shorter removes a region with a dead replica "
        "sooner.",
    )
    backoff_cap: float = Field(
        default=30.0,
        gt=0,
        description="Largest delay ceiling between polls of a binding whose polls fail (seconds).",
    )


class KubeSettings(BaseModel):
    """Everything ``region_agent.kube`` needs; composed into the agent settings as ``kube``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: Literal["auto", "in-cluster", "kubeconfig"] = Field(
        default="auto",
        description="Where the API address and credentials come from. auto: in-cluster when "
        "KUBERNETES_SERVICE_HOST is set (a pod), otherwise the kubeconfig.",
    )
    kubeconfig: str | None = Field(
        default=None, description="kubeconfig path; None uses $KUBECONFIG or ~/.kube/config."
    )
    context: str | None = Field(default=None, description="kubeconfig context; None uses the current context.")
    namespace: str | None = Field(
        default=None,
        description="Namespace to watch Services and Clusters in. None watches all namespaces, which needs "
        "cluster-wide list/watch RBAC but sees every project.",
    )
    copy_label_selector: str = Field(
        default="region-agent.io/project",
        description="Label selector choosing which Knative Services are copies of global projects; sent to "
        "the apiserver so other Services never reach the agent's memory.",
    )
    slug_label: str = Field(
        default="region-agent.io/project",
        description="Label on a copy's Knative Service holding its project slug; a Service without it (or "
        "with an invalid slug) uses its own name.",
    )
    binding_label: str = Field(
        default="region-agent.io/project",
        description="Label on a CloudNativePG Cluster naming the project slug it serves; only Clusters with "
        "it are watched, and a copy's bindings are the Clusters whose label equals its slug.",
    )
    node_name: str | None = Field(
        default=None,
        description="This node's name (downward API `spec.nodeName`), for the Pods-on-this-node watch of "
        "usage metering. None: no pod watch.",
    )
    lag_threshold: float = Field(
        default=30.0,
        gt=0,
        description="Replay lag (seconds) above which a streaming replica is reported lagging: the region is "
        "degraded but the copy stays in the DNS answers. Only `data-not-streaming` removes a copy.",
    )
    watch: WatchSettings = Field(default_factory=WatchSettings, description="Informer timeouts and backoff.")
    cnpg: CnpgStatusSettings = Field(default_factory=CnpgStatusSettings, description="CloudNativePG status polling.")
