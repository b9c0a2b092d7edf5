"""Fixtures for the Kubernetes side: a fake apiserver and a real kubernetes_asyncio client on it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration
from prometheus_client import CollectorRegistry

from region_agent.kube.models import KnativeService
from region_agent.kube.resources import KNATIVE_SERVICES, ResourceRef
from region_agent.kube.settings import WatchSettings
from region_agent.kube.watch import Informer
from tests.conftest import wait_for
from tests.fakes.kube_api import FakeKubeApi

# Short everything so the suite stays fast; each test overrides what it exercises.
FAST_WATCH = WatchSettings(
    server_timeout_min=30,
    server_timeout_max=30,
    read_margin=5.0,
    connect_timeout=2.0,
    list_timeout=5.0,
    page_size=500,
    backoff_initial=0.01,
    backoff_cap=0.05,
    backoff_reset_after=5.0,
    very_short_watch=0.0,
)


@pytest.fixture
async def fake() -> AsyncIterator[FakeKubeApi]:
    server = FakeKubeApi()
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def api(fake: FakeKubeApi) -> AsyncIterator[Any]:
    configuration = Configuration(host=fake.url)
    async with ApiClient(configuration) as client:
        yield client


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def rng() -> random.Random:
    return random.Random(7)


InformerFactory = Callable[..., Awaitable["Informer[Any]"]]


@pytest.fixture
async def start_informer(api: Any, registry: CollectorRegistry, rng: random.Random) -> AsyncIterator[InformerFactory]:
    """Build an informer (Knative Services by default), run it as a task, cancel it at teardown."""
    tasks: list[asyncio.Task[None]] = []

    async def start(
        *,
        resource: ResourceRef = KNATIVE_SERVICES,
        convert: Callable[[Mapping[str, Any]], Any] | None = None,
        settings: WatchSettings = FAST_WATCH,
        wait_synced: bool = True,
        **kwargs: Any,
    ) -> Informer[Any]:
        informer: Informer[Any] = Informer(
            api=api,
            resource=resource,
            convert=convert or KnativeService.from_api,
            settings=settings,
            registry=registry,
            rng=rng,
            **kwargs,
        )
        tasks.append(asyncio.create_task(informer.run(), name=f"test informer {informer.name}"))
        if wait_synced:
            await wait_for(informer.synced.is_set, timeout=5, message=f"{informer.name} synced")
        return informer

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
