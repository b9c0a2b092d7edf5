"""What the agent runs for health, in either mode, behind one small surface.

The supervisor builds one :class:`HealthService`, starts :meth:`HealthService.run` as a
guarded task and calls :meth:`HealthService.publish` with every new :class:`RegionView`.

- in-process (the default): the public listener (``port``, 8086) runs in the agent,
  answering from a :class:`~region_agent.health.source.ViewHolder`; ``publish`` is one attribute store;
- sidecar: the agent runs only the :class:`~region_agent.health.feed.FeedPublisher`; a separate
  ``region-agent health`` process (:func:`region_agent.health.sidecar.run_sidecar`) answers publicly.

In both modes the agent serves its operator listener (``operator_port``, 8087): /metrics,
/zone, verbose health answers, /livez and /readyz.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry

from region_agent.base.clock import Clock
from region_agent.health.feed import FeedPublisher
from region_agent.health.listener import HealthListener, ListenError, Role
from region_agent.health.metrics import ListenerMetrics, ViewCollector
from region_agent.health.operator import Document
from region_agent.health.settings import HealthMode, HealthSettings
from region_agent.health.source import ViewHolder
from region_agent.state.local import RegionView

__all__ = ["HealthService"]


class HealthService:
    def __init__(
        self,
        settings: HealthSettings,
        *,
        region: str,
        registry: CollectorRegistry,
        clock: Clock | None = None,
        documents: Mapping[str, Document] | None = None,
        handlers: Mapping[str, Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]] | None = None,
    ) -> None:
        """``documents``: extra JSON endpoints of the operator listener (path → :class:`Document`).

        ``handlers``: path prefixes the operator listener hands to another handler (the control
        API: ``{region_agent.control.PREFIX: ControlAPI.handle}``).
        """
        self.settings = settings
        self.holder = ViewHolder()
        self.publisher: FeedPublisher | None = None
        metrics = ListenerMetrics(registry)
        registry.register(ViewCollector(self.holder.current))
        self.listener: HealthListener | None = None  # the public one, when it runs in this process
        if settings.mode is HealthMode.SIDECAR:
            self.publisher = FeedPublisher.from_settings(settings, registry=registry)
        else:
            self.listener = HealthListener(
                region=region, source=self.holder, settings=settings, registry=registry, clock=clock,
                metrics=metrics,
            )
        self.operator = HealthListener(
            region=region, source=self.holder, settings=settings, registry=registry, clock=clock,
            role=Role.OPERATOR, metrics=metrics, documents=documents, handlers=handlers,
        )

    def publish(self, view: RegionView) -> None:
        """Hand over a new view; never blocks. Call on every change of the local view."""
        self.holder.set(view)
        if self.publisher is not None:
            self.publisher.publish(view)

    async def start(self) -> None:
        """Bind the listeners and, in sidecar mode, the feed socket; raises on failure."""
        await self.operator.start()
        try:
            if self.listener is not None:
                await self.listener.start()
            if self.publisher is not None:
                await self._start_feed(self.publisher)
        except BaseException:
            await self.stop()
            raise

    async def _start_feed(self, publisher: FeedPublisher) -> None:
        try:
            await publisher.start()
        except OSError as exc:  # a directory not writable, a path that is a directory: name the setting
            raise ListenError("health.feed_socket", str(self.settings.feed_socket), exc,
                              also="health.mode") from exc

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.stop()
        if self.listener is not None:
            await self.listener.stop()
        await self.operator.stop()
