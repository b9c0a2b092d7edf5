"""What makes this agent degraded: each component reports its own problems, the registry gathers them.

A component that can be degraded has ``problems() -> tuple[str, ...]``: one line per problem, for
the operator (the public listener shows only a code). The supervisor registers every component
once; ``/health/region``, ``X-Degraded`` and the degraded metric read :meth:`Problems.current`.
"""

from __future__ import annotations

from typing import Protocol


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
