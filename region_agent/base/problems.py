"""What makes this agent degraded: each component reports its own problems, the registry gathers them.

A component that can be degraded has ``problems() -> tuple[str, ...]``: one line per problem, for
the operator (the public listener shows only a code). The supervisor registers every component
once; ``/health/region``, ``X-Degraded`` and the degraded metric read :meth:`Problems.current`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class HasProblems(Protocol):
    def problems(self) -> tuple[str, ...]:
        """Why this component is degraded now, one line each; empty when it is not."""
        ...


class Problems:
    """The agent's problem sources, asked in registration order."""

    def __init__(self) -> None:
        self._sources: list[HasProblems] = []

    def register(self, *sources: HasProblems | None) -> None:
        """Add sources; None (a component this agent does not run) is skipped."""
        self._sources.extend(source for source in sources if source is not None)

    def current(self) -> tuple[str, ...]:
        return tuple(line for source in self._sources for line in source.problems())


def source_name(source: object) -> str:
    """A bounded label for a problem source: its class name in snake case (``TaskSupervisor`` → ``task_supervisor``)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(source).__name__).lower()


class ProblemsCollector(Collector):
    """``region_agent_degraded`` (1 while the agent has any problem) and ``region_agent_degraded_sources{source}``
    (each registered source's count of problem lines now, 0 included: which part is degraded)."""

    def __init__(self, problems: Problems) -> None:
        self._problems = problems

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_source: dict[str, int] = {}
        for source in self._problems._sources:
            name = source_name(source)
            by_source[name] = by_source.get(name, 0) + len(source.problems())
        yield GaugeMetricFamily("region_agent_degraded", "1 while the agent is degraded (any problem: "
                                "/health/region lists them)", value=1 if any(by_source.values()) else 0)
        sources = GaugeMetricFamily("region_agent_degraded_sources", "Problem lines now, by the part of the agent "
                                    "that reports them", labels=["source"])
        for name, count in sorted(by_source.items()):
            sources.add_metric([name], count)
        yield sources

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())
