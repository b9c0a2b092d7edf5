"""Where the listener gets its view from: the seam between the listener and its feeders.

The listener asks a :class:`ViewSource` once per request for the current view and its
freshness. In-process, the agent swaps a new immutable :class:`RegionView` into a
:class:`ViewHolder` on every change (one attribute store, so readers never see half a
view); in the sidecar, :class:`region_agent.health.feed.FeedSubscriber` is the source and decides
freshness by the staleness rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from region_agent.health.views import IN_PROCESS, Freshness
from region_agent.state.local import RegionView

__all__ = ["CallableSource", "ViewHolder", "ViewSource", "as_source"]


@runtime_checkable
class ViewSource(Protocol):
    """Called on every request from the listener's event loop: must be cheap and not block."""

    def current(self) -> tuple[RegionView | None, Freshness]: ...


class ViewHolder:
    """The in-process source: the agent calls :meth:`set` with each new view."""

    __slots__ = ("_current",)

    def __init__(self, view: RegionView | None = None) -> None:
        self._current: tuple[RegionView | None, Freshness] = (view, IN_PROCESS)

    def set(self, view: RegionView) -> None:
        self._current = (view, IN_PROCESS)

    def get(self) -> RegionView | None:
        return self._current[0]

    def current(self) -> tuple[RegionView | None, Freshness]:
        return self._current


class CallableSource:
    """Adapts a plain ``() -> RegionView | None`` provider (always fresh: in-process)."""

    __slots__ = ("_provider",)

    def __init__(self, provider: Callable[[], RegionView | None]) -> None:
        self._provider = provider

    def current(self) -> tuple[RegionView | None, Freshness]:
        return self._provider(), IN_PROCESS


def as_source(source: ViewSource | Callable[[], RegionView | None]) -> ViewSource:
    if isinstance(source, ViewSource):
        return source
    return CallableSource(source)
