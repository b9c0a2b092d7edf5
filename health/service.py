"""What the agent runs for health, in either mode, behind one small surface.

The supervisor builds one :class:`HealthService`, starts :meth:`HealthService.run` as a
guarded task and calls :meth:`HealthService.publish` with every new :class:`RegionView`.

- in-process (the default): the listener runs in the agent, answering from a
  :class:`~health.source.ViewHolder`; ``publish`` is one attribute store;
- sidecar: the agent runs only the :class:`~health.feed.FeedPublisher`; a separate
  ``region-agent health`` process (:func:`health.sidecar.run_sidecar`) answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry

from agent.base.clock import Clock
from agent.state.local import RegionView
from health.feed import FeedPublisher
from health.listener import HealthListener
from health.settings import HealthMode, HealthSettings
from health.source import ViewHolder

__all__ = ["HealthService"]


class HealthService:
    def __init__(
        self,
        settings: HealthSettings,
        *,
        region: str,
        registry: CollectorRegistry,
        clock: Clock | None = None,
        documents: Mapping[str, Callable[[], object]] | None = None,
    ) -> None:
        """``documents``: extra JSON endpoints of the agent's listener (path → provider)."""
        self.settings = settings
        self.holder = ViewHolder()
        self.publisher: FeedPublisher | None = None
        listener_settings = settings
        if settings.mode is HealthMode.SIDECAR:
            # The sidecar answers on `port`; the agent keeps its metrics and probes on `agent_port`.
            self.publisher = FeedPublisher.from_settings(settings, registry=registry)
            listener_settings = settings.model_copy(update={"port": settings.agent_port})
        self.listener = HealthListener(
            region=region, source=self.holder, settings=listener_settings, registry=registry, clock=clock,
            documents=documents,
        )

    def publish(self, view: RegionView) -> None:
        """Hand over a new view; never blocks. Call on every change of the local view."""
        self.holder.set(view)
        if self.publisher is not None:
            self.publisher.publish(view)

    async def start(self) -> None:
        """Bind the listener (in-process) or the feed socket (sidecar); raises on failure."""
        await self.listener.start()
        if self.publisher is not None:
            await self.publisher.start()

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.stop()
        await self.listener.stop()

    async def run(self) -> None:
        """Start, serve until cancelled, stop (for ``create_guarded_task``)."""
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

