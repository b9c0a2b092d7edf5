"""Prometheus metrics of usage metering (``region_agent_usage_*``), registered on a given registry.

Every long-running loop (event processing, checkpoints, reporting) exports its last success
time and its errors, as DESIGN.md asks; the spool gauges are refreshed after every spool call
so they never need a query of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from region_agent.usage.spool import SpoolStats


@dataclass(frozen=True)
class UsageMetrics:
    open_sessions: Gauge
    sessions_opened: Counter
    sessions_recorded: Counter
    records_written: Counter
    seconds_written: Counter
    records_reported: Counter
    records_quarantined: Counter
    key_conflicts: Counter
    spool_bytes: Gauge
    spool_max_bytes: Gauge
    spool_unsent: Gauge
    spool_quarantined: Gauge
    oldest_unsent_age: Gauge
    oldest_unsent_written: Gauge
    report_seconds: Histogram
    report_errors: Counter
    loop_errors: Counter
    last_success: Gauge
    spool_available: Gauge
    spool_open_errors: Counter
    spool_moved_aside: Counter
    journal_events: Gauge
    journal_dropped: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> UsageMetrics:
        p = "region_agent_usage_"
        return cls(
            open_sessions=Gauge(p + "open_sessions", "Sessions open now (pods running on this node).",
                                registry=registry),
            sessions_opened=Counter(p + "sessions_opened", "Sessions opened.", registry=registry),
            sessions_recorded=Counter(p + "sessions_recorded",
                                      "Sessions closed and written to the spool, by end reason.",
                                      ["end_reason"], registry=registry),
            records_written=Counter(p + "records_written", "Usage records (slices) written to the spool.",
                                    registry=registry),
            seconds_written=Counter(p + "billed_seconds_written",
                                    "Pod-seconds in records written to the spool.", registry=registry),
            records_reported=Counter(p + "records_reported",
                                     "Records acknowledged by the control plane (2xx).", registry=registry),
            records_quarantined=Counter(p + "records_quarantined",
                                        "Records put aside in the quarantine table, by reason.", ["reason"],
                                        registry=registry),
            key_conflicts=Counter(p + "key_conflicts",
                                  "Records whose key was already spooled with other content (a bug; "
                                  "quarantined, never dropped).", registry=registry),
            spool_bytes=Gauge(p + "spool_bytes", "Live bytes in the SQLite spool.", registry=registry),
            spool_max_bytes=Gauge(p + "spool_max_bytes", "Configured bound of the spool (bytes).",
                                  registry=registry),
            spool_unsent=Gauge(p + "spool_unsent_records", "Records spooled and not yet acknowledged.",
                               registry=registry),
            spool_quarantined=Gauge(p + "spool_quarantined_records", "Records in the quarantine table.",
                                    registry=registry),
            oldest_unsent_age=Gauge(p + "oldest_unsent_age_seconds",
                                    "Age of the oldest unacknowledged record (0 when none).",
                                    registry=registry),
            oldest_unsent_written=Gauge(p + "oldest_unsent_timestamp_seconds",
                                        "When the oldest unacknowledged record was spooled (Unix time; "
                                        "0 when none). Alert on time() minus this.", registry=registry),
            report_seconds=Histogram(p + "report_duration_seconds",
                                     "Duration of one POST to the control plane, any outcome.",
                                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                     registry=registry),
            report_errors=Counter(p + "report_errors",
                                  "Failed POSTs, by kind: network, timeout, status_5xx, status_429, "
                                  "status_retry (retried 4xx), rejected (4xx verdict), config.", ["kind"],
                                  registry=registry),
            loop_errors=Counter(p + "loop_errors", "Unexpected errors in a usage loop (retried), by loop.",
                                ["loop"], registry=registry),
            last_success=Gauge(p + "last_success_timestamp_seconds",
                               "Last time each loop completed a round (Unix time): events, checkpoint, "
                               "report.", ["loop"], registry=registry),
            spool_available=Gauge(p + "spool_available",
                                  "1 while the spool is open and writable, 0 while events wait in the "
                                  "in-memory journal and nothing is reported.", registry=registry),
            spool_open_errors=Counter(p + "spool_open_errors",
                                      "Failed attempts to open the spool, by kind: unavailable, read-only, "
                                      "corrupt.", ["kind"], registry=registry),
            spool_moved_aside=Counter(p + "spool_moved_aside",
                                      "Corrupt spool files renamed aside (never deleted) for a fresh one; "
                                      "their unsent records need an operator.", registry=registry),
            journal_events=Gauge(p + "journal_events",
                                 "Events waiting in memory to be applied (while the spool is unavailable: "
                                 "the journal's fill; bound: journal_size).", registry=registry),
            journal_dropped=Counter(p + "journal_dropped_events",
                                    "Pod events dropped because the journal was full while the spool was "
                                    "unavailable (a reconcile with the pod list follows).", registry=registry),
        )

    def observe_spool(self, stats: SpoolStats, now: float) -> None:
        self.spool_bytes.set(stats.bytes)
        self.spool_unsent.set(stats.unsent)
        self.spool_quarantined.set(stats.quarantined)
        if stats.oldest_unsent_at is None:
            self.oldest_unsent_age.set(0)
            self.oldest_unsent_written.set(0)
        else:
            self.oldest_unsent_age.set(max(0.0, now - stats.oldest_unsent_at))
            self.oldest_unsent_written.set(stats.oldest_unsent_at)
