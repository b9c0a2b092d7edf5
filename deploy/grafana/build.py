"""Writes region-agent.json, the Grafana dashboard, from the panel list below (one place to edit).

    python deploy/grafana/build.py          # rewrites deploy/grafana/region-agent.json

Every query is evaluated by tests/e2e/test_dashboard.py against a real Prometheus scraping real agents
and must return data. ``$instance`` (a multi-value variable over region_agent_build_info) selects
agents; ``$__rate_interval`` is Grafana's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

I = 'instance=~"$instance"'   # noqa: E741 (short on purpose: every query carries it)
R = "$__rate_interval"

# (row, [(title, unit, [(expr, legend)])])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Cluster", [
        ("Regions in the answers (min over agents)", "none",
         [(f"min by (region) (region_agent_cluster_region_in_answers{{{I}}})", "{{region}}")]),
        ("Majority of regions seen", "none", [(f"region_agent_cluster_majority{{{I}}}", "{{instance}}")]),
        ("Live agents per region (min over agents)", "none",
         [(f"min by (region) (region_agent_gossip_region_members{{{I}}})", "{{region}}")]),
        ("Members declared dead", "none",
         [(f"sum by (instance) (increase(region_agent_gossip_deaths_total{{{I}}}[{R}]))", "{{instance}}")]),
        ("Peers holding this agent's digest", "none",
         [(f"region_agent_gossip_peers_in_sync{{{I}}}", "{{instance}}")]),
        ("Clock offset to the peers' median", "s", [(f"region_agent_clock_offset_seconds{{{I}}}", "{{instance}}")]),
    ]),
    ("Answers", [
        ("Projects by answer state", "none",
         [(f"max by (answer) (region_agent_dns_projects{{{I}}})", "{{answer}}")]),
        ("Regions without a healthy copy, by project", "none",
         [(f"max by (project) (region_agent_dns_project_regions_out{{{I}}})", "{{project}}")]),
        ("Projects naming an unconfigured region", "none",
         [(f"max(region_agent_state_projects_missing_regions{{{I}}})", "projects")]),
        ("Zone serial per agent", "none", [(f"region_agent_dns_zone_serial{{{I}}}", "{{instance}}")]),
    ]),
    ("DNS", [
        ("Responses by rcode", "reqps",
         [(f"sum by (rcode) (rate(region_agent_dns_responses_total{{{I}}}[{R}]))", "{{rcode}}")]),
        ("Answer time (p50, p99, in the agent)", "s", [
            (f"histogram_quantile(0.5, sum by (le) (rate(region_agent_dns_answer_seconds_bucket{{{I}}}[{R}])))",
             "p50"),
            (f"histogram_quantile(0.99, sum by (le) (rate(region_agent_dns_answer_seconds_bucket{{{I}}}[{R}])))",
             "p99")]),
    ]),
    ("Gossip", [
        ("Messages received", "pps",
         [(f'sum by (instance) (rate(region_agent_gossip_messages_total{{direction="received", {I}}}[{R}]))',
           "{{instance}}")]),
        ("Traffic refused, by reason", "pps",
         [(f"sum by (reason) (rate(region_agent_gossip_rejected_total{{{I}}}[{R}]))", "{{reason}}")]),
        ("Anti-entropy rounds, by result", "ops",
         [(f"sum by (result) (rate(region_agent_gossip_sync_rounds_total{{{I}}}[{R}]))", "{{result}}")]),
        ("Store entries refused, by reason", "none",
         [(f"sum by (reason) (increase(region_agent_state_merge_rejected_total{{{I}}}[{R}]))", "{{reason}}")]),
        ("Certificate expiry", "s",
         [(f"min by (instance, certificate) (region_agent_certificate_expiry_timestamp_seconds{{{I}}}) - time()",
           "{{instance}} {{certificate}}")]),
    ]),
    ("Usage", [
        ("Open sessions", "none", [(f"sum by (instance) (region_agent_usage_open_sessions{{{I}}})", "{{instance}}")]),
        ("Oldest unsent record", "s",
         [(f"max by (instance) (region_agent_usage_oldest_unsent_age_seconds{{{I}}})", "{{instance}}")]),
        ("Records spooled and reported", "ops", [
            (f"sum(rate(region_agent_usage_records_written_total{{{I}}}[{R}]))", "spooled"),
            (f"sum(rate(region_agent_usage_records_reported_total{{{I}}}[{R}]))", "reported")]),
        ("Spool writable", "none",
         [(f"min by (instance) (region_agent_usage_spool_available{{{I}}})", "{{instance}}")]),
    ]),
    ("Agent", [
        ("Degraded, by source", "none",
         [(f"sum by (instance, source) (region_agent_degraded_sources{{{I}}})", "{{instance}} {{source}}")]),
        ("Task restarts", "none",
         [(f"sum by (task) (increase(region_agent_task_restarts_total{{{I}}}[{R}]))", "{{task}}")]),
        ("Version", "none", [(f"region_agent_build_info{{{I}}}", "{{instance}} {{version}} {{role}}")]),
    ]),
]


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    ident = 1
    for row, charts in ROWS:
        panels.append({"type": "row", "title": row, "id": ident, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        ident += 1
        y += 1
        for index, (title, unit, queries) in enumerate(charts):
            panels.append({
                "type": "timeseries", "title": title, "id": ident,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 8, "x": 8 * (index % 3), "y": y + 8 * (index // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": chr(ord("A") + n), "expr": expr, "legendFormat": legend,
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                            for n, (expr, legend) in enumerate(queries)],
            })
            ident += 1
        y += 8 * ((len(charts) + 2) // 3)
    return {
        "title": "region-agent", "uid": "region-agent", "schemaVersion": 38, "version": 1,
        "tags": ["region-agent"], "timezone": "utc", "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"type": "query", "name": "instance", "label": "agent", "multi": True, "includeAll": True,
             "allValue": ".*", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(region_agent_build_info, instance)", "refId": "instance"},
             "definition": "label_values(region_agent_build_info, instance)", "refresh": 2},
        ]},
        "panels": panels,
    }


def main() -> None:
    out = Path(__file__).with_name("region-agent.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
