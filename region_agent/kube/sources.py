"""The Kubernetes sources of one agent, wired from ``KubeSettings``: what the supervisor runs.

``KubeSources`` builds the Knative Service informer, the CNPG Cluster informer and the CNPG
status poller (when ``cnpg.enabled``), gives the supervisor the coroutine factories to run as
supervised (restartable) tasks, one ``changed`` signal for "rebuild the RegionView", and :meth:`KubeSources.view` to do
the rebuild. ``node_pods_informer`` builds the Pods-on-this-node informer for usage metering
from the same settings.

Wiring (in the supervisor)::

    api = await build_api_client(settings.kube)
    kube = KubeSources(api=api, settings=settings.kube, registry=registry)
    for name, factory in kube.runners().items():
        supervisor.spawn(name, factory)
    while True:                      # a guarded task of its own
        await kube.changed.wait(); kube.changed.clear()
        snapshot = kube.view()       # KubeSnapshot: copies, bindings, synced, ..., watch_errors
        ...                          # build RegionView, write copy health to the store
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry

from region_agent.base.clock import Clock, SystemClock
from region_agent.kube.cnpg_poller import CnpgStatusPoller
from region_agent.kube.local_view import ServiceVerdicts, build_local_view
from region_agent.kube.models import CnpgCluster, KnativeService
from region_agent.kube.resources import CNPG_CLUSTERS, KNATIVE_SERVICES
from region_agent.kube.settings import KubeSettings
from region_agent.kube.watch import Informer
from region_agent.state.local import BindingStatus, CopyStatus


@dataclass(frozen=True, slots=True)
class KubeSnapshot:
    """Everything the RegionView needs from the Kubernetes side, at one instant."""

    copies: dict[str, CopyStatus] = field(default_factory=dict)
    bindings: tuple[BindingStatus, ...] = ()
    synced: bool = False  # every informer has completed its first LIST
    synced_at: float | None = None  # wall time the last of them did
    last_event_at: float | None = None
    watch_errors: tuple[str, ...] = ()


class KubeSources:
    def __init__(
        self, *, api: Any, settings: KubeSettings, registry: CollectorRegistry, clock: Clock | None = None
    ) -> None:
        self.settings = settings
        self.changed = asyncio.Event()
        """Set on every change a view rebuild could notice; the consumer clears it."""
        clock = clock or SystemClock()
        self._verdicts = ServiceVerdicts()
        self.services: Informer[KnativeService] = Informer(
            api=api,
            resource=KNATIVE_SERVICES.in_namespace(settings.namespace),
            convert=partial(KnativeService.from_api, keep_labels=(settings.slug_label,)),
            label_selector=settings.copy_label_selector or None,
            settings=settings.watch,
            registry=registry,
            clock=clock,
            name="knative-services",
        )
        self.clusters: Informer[CnpgCluster] | None = None
        self.cnpg: CnpgStatusPoller | None = None
        if settings.cnpg.enabled:
            self.clusters = Informer(
                api=api,
                resource=CNPG_CLUSTERS.in_namespace(settings.namespace),
                convert=partial(CnpgCluster.from_api, keep_labels=(settings.binding_label,)),
                label_selector=settings.binding_label,
                settings=settings.watch,
                registry=registry,
                clock=clock,
                name="cnpg-clusters",
            )
            self.cnpg = CnpgStatusPoller(
                api=api, clusters=self.clusters, settings=settings, registry=registry, clock=clock
            )
            self.cnpg.add_listener(self.changed.set)
        for informer in self._informers():
            informer.add_handler(lambda _event: self.changed.set())
            informer.add_state_listener(self.changed.set)

    def _informers(self) -> list[Informer[Any]]:
        return [self.services] + ([self.clusters] if self.clusters is not None else [])

    def runners(self) -> dict[str, Callable[[], Coroutine[Any, Any, None]]]:
        """Task name → coroutine factory; each runs until shutdown, restarted if it fails."""
        runners: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
            "kube-watch knative-services": self.services.run}
        if self.clusters is not None and self.cnpg is not None:
            runners["kube-watch cnpg-clusters"] = self.clusters.run
            runners["kube-cnpg-status"] = self.cnpg.run
        return runners

    @property
    def synced(self) -> bool:
        return all(informer.synced.is_set() for informer in self._informers())

    def view(self) -> KubeSnapshot:
        informers = self._informers()
        local = build_local_view(
            services=self.services.items,
            services_synced=self.services.synced.is_set(),
            slug_label=self.settings.slug_label,
            clusters=self.clusters.items if self.clusters is not None else None,
            clusters_synced=self.clusters.synced.is_set() if self.clusters is not None else True,
            binding_statuses=self.cnpg.statuses if self.cnpg is not None else None,
            binding_label=self.settings.binding_label,
            verdicts=self._verdicts,
        )
        synced = self.synced
        event_times = [i.last_event_at for i in informers if i.last_event_at is not None]
        return KubeSnapshot(
            copies=local.copies,
            bindings=local.bindings,
            synced=synced,
            synced_at=max(i.synced_at or 0.0 for i in informers) if synced else None,
            last_event_at=max(event_times) if event_times else None,
            watch_errors=tuple(i.error for i in informers if i.error),
        )
