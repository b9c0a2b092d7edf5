"""The usage part's wiring, in one place: the pod watch of this node and the service that reads it.

The supervisor (``region_agent.app.supervisor.Agent._start_usage``), the tests and the benches all build
usage metering here, so what a test exercises is what ``region-agent run`` runs. Not imported by
``region_agent.usage`` itself: it pulls in the Kubernetes client, which standalone mode never loads.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry

from region_agent.base.clock import Clock
from region_agent.kube.resources import PODS
from region_agent.kube.settings import WatchSettings
from region_agent.kube.watch import Informer
from region_agent.usage.pods import MeteredPod, pod_converter, pod_selectors
from region_agent.usage.reporter import Sleep
from region_agent.usage.service import UsageService
from region_agent.usage.settings import UsageSettings


def build_usage(
    settings: UsageSettings, *, api: Any, registry: CollectorRegistry, region: str, node: str,
    watch: WatchSettings, clock: Clock | None = None, sleep: Sleep = asyncio.sleep,
) -> tuple[Informer[MeteredPod], UsageService]:
    """The pod informer (pods on ``node`` with the service label) and the usage service reading it.

    Run both: ``informer.run()`` and ``service.run()``. The service registers its event handler
    here, before the informer runs, so no event is missed; stop the service first (it
    checkpoints open sessions while the informer still exists). ``clock`` and ``sleep`` are for
    simulated time in tests.
    """
    label_selector, field_selector = pod_selectors(settings, node)
    informer: Informer[MeteredPod] = Informer(
        api=api, resource=PODS, convert=pod_converter(settings), label_selector=label_selector,
        field_selector=field_selector, settings=watch, registry=registry, name="usage-pods")
    service = UsageService(settings, region=region, node=node, pods=informer, registry=registry, clock=clock,
                           sleep=sleep)
    return informer, service
