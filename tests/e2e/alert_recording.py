"""Record real agents' /metrics during a fault and turn them into a ``promtool test rules`` file.

The alert rules (deploy/prometheus/alerts.yaml) are unit-tested on series the agents really export:
a scenario scrapes every agent's operator ``/metrics`` once per second, keeps the series the rules
read (with ``instance`` set to the agent's region, as one scrape target per agent), and writes them
as promtool ``input_series`` with an ``interval`` of :data:`SCALE` seconds per real second, so the
rules' ``for:`` durations (minutes) are met by a recording of seconds. Values are the agents'; only
time is stretched. A series absent from a scrape (an agent killed) is ``_`` (no sample), as
Prometheus would see it.

The expected alerts are declared per scenario (:class:`Expect`) and rendered with the rules' own
annotation templates (only ``{{ $labels.<name> }}`` is used in them), so a changed rule text
needs no second copy here.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus"
SCALE = 15   # rule seconds per recorded second

# The series the rules read (sample names as exposed).
RECORDED = (
    "region_agent_cluster_region_in_answers", "region_agent_cluster_majority", "region_agent_gossip_region_members",
    "region_agent_gossip_deaths_total", "region_agent_clock_outlier", "region_agent_state_merge_rejected_total",
    "region_agent_dns_zone_serial", "region_agent_task_running",
)

Scrape = Callable[[], Awaitable[str]]


def _labels(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


@dataclass
class Recording:
    """Samples by series, one slot per tick; events name the tick something was done at."""

    ticks: int = 0
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)

    def add(self, instance: str, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in RECORDED:
                    continue
                key = sample.name + _labels({**sample.labels, "instance": instance})
                self.series.setdefault(key, {})[self.ticks] = float(sample.value)

    def mark(self, event: str) -> None:
        self.events[event] = self.ticks

    def input_series(self) -> list[dict[str, str]]:
        rows = []
        for key in sorted(self.series):
            samples = self.series[key]
            values = " ".join(_number(samples[t]) if t in samples else "_" for t in range(self.ticks))
            rows.append({"series": key, "values": values})
        return rows


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


async def record(recording: Recording, scrapes: dict[str, Scrape], seconds: float) -> None:
    """Scrape every agent once per second for ``seconds`` (an agent that does not answer: no sample)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        texts = await asyncio.gather(*(scrape() for scrape in scrapes.values()), return_exceptions=True)
        for instance, text in zip(scrapes, texts, strict=True):
            if isinstance(text, str) and text:
                recording.add(instance, text)
        recording.ticks += 1
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))


@dataclass(frozen=True)
class Expect:
    """``alert`` with ``labels`` (besides the rule's own) firing at recorded tick ``at``; ``labels`` None:
    the alert must be silent then."""

    alert: str
    at: int
    labels: tuple[dict[str, str], ...] | None = None


def _rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load((RULES / "alerts.yaml").read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


_TEMPLATE = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")


def _render(template: str, labels: dict[str, str]) -> str:
    if "{{" in _TEMPLATE.sub("", template):
        raise ValueError(f"only $labels templates can be rendered here: {template!r}")
    return _TEMPLATE.sub(lambda m: labels.get(m.group(1), ""), template)


def promtool_test(name: str, recording: Recording, expects: Iterable[Expect]) -> dict[str, Any]:
    rules = _rules()
    cases = []
    for expect in expects:
        rule = rules[expect.alert]
        alerts = []
        for extra in expect.labels or ():
            labels = {**rule.get("labels", {}), **extra}
            alerts.append({"exp_labels": labels,
                           "exp_annotations": {k: _render(v, labels) for k, v in rule.get("annotations", {}).items()}})
        cases.append({"eval_time": f"{expect.at * SCALE}s", "alertname": expect.alert, "exp_alerts": alerts})
    return {"name": name, "interval": f"{SCALE}s", "input_series": recording.input_series(),
            "alert_rule_test": cases}


def write_tests(path: Path, tests: list[dict[str, Any]]) -> None:
    document = {"rule_files": [str(RULES / "alerts.yaml") if path.parent != RULES else "alerts.yaml"],
                "evaluation_interval": f"{SCALE}s", "tests": tests}
    header = ("# Recorded from real agents by tests/e2e/test_alert_recordings.py (REGION_AGENT_RECORD=1 rewrites\n"
              f"# it); one sample per second, stretched to {SCALE} s. promtool test rules recorded_test.yaml\n")
    path.write_text(header + yaml.safe_dump(document, sort_keys=False, width=10_000))
