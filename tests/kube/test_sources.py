"""KubeSources end to end: fake apiserver + fake CNPG instance manager → copies and bindings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from region_agent.kube.resources import CNPG_CLUSTERS, KNATIVE_SERVICES, PODS
from region_agent.kube.settings import CnpgStatusSettings, KubeSettings
from region_agent.kube.sources import KubeSources
from region_agent.state.local import CopyReason
from tests.conftest import wait_for
from tests.fakes.cnpg_instance import FakeCnpgInstance
from tests.fakes.kube_api import FakeKubeApi
from tests.fakes.kube_objects import cnpg_cluster, knative_service, pod
from tests.kube.conftest import FAST_WATCH


@pytest.fixture
async def instance() -> AsyncIterator[FakeCnpgInstance]:
    server = FakeCnpgInstance()
    await server.start()
    yield server
    await server.close()


def settings_for(instance: FakeCnpgInstance, **cnpg: Any) -> KubeSettings:
    return KubeSettings(
        watch=FAST_WATCH,
        cnpg=CnpgStatusSettings(
            status_port=instance.status_port,
            metrics_port=instance.metrics_port,
            poll_interval=0.05,
            request_timeout=1.0,
            grace=0.3,
            backoff_cap=0.1,
            **cnpg,
        ),
    )


@pytest.fixture
async def running() -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks: list[asyncio.Task[None]] = []
    yield tasks
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def start(sources: KubeSources, tasks: list[asyncio.Task[None]]) -> None:
    for name, factory in sources.runners().items():
        tasks.append(asyncio.create_task(factory(), name=name))


async def test_copies_and_bindings_follow_the_cluster(
    fake: FakeKubeApi, api: Any, instance: FakeCnpgInstance, running: list[asyncio.Task[None]]
) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    fake.put(KNATIVE_SERVICES, knative_service("blog"))
    fake.put(KNATIVE_SERVICES, knative_service("unlabelled", labels={}))  # not a copy: filtered by the server
    fake.put(CNPG_CLUSTERS, cnpg_cluster("shop-db", slug="shop"))
    fake.put(
        PODS,
        pod(
            "shop-db-1",
            ip="127.0.0.1",
            labels={"cnpg.io/cluster": "shop-db"},
            containers=[{"name": "postgres", "command": ["/controller/manager", "instance", "run"]}],
        ),
    )
    registry = CollectorRegistry()
    sources = KubeSources(api=api, settings=settings_for(instance), registry=registry)
    assert not sources.view().synced and sources.view().copies == {}
    start(sources, running)

    def shop_reason() -> CopyReason | None:
        copy = sources.view().copies.get("shop")
        return None if copy is None else copy.reason

    await wait_for(lambda: shop_reason() is CopyReason.OK, message="shop healthy")
    view = sources.view()
    assert view.synced and view.synced_at is not None and view.watch_errors == ()
    assert set(view.copies) == {"shop", "blog"}
    assert view.copies["blog"].healthy  # no bindings, no data condition
    (binding,) = view.bindings
    assert binding.streaming and binding.lag_seconds == 1.5 and binding.name == "shop-db"
    assert (
        registry.get_sample_value("region_agent_kube_cnpg_streaming", {"namespace": "projects", "cluster": "shop-db"})
        == 1
    )

    # The replica stops streaming: the copy leaves the answers.
    sources.changed.clear()
    instance.status = {**instance.status, "isWalReceiverActive": False}
    await wait_for(lambda: shop_reason() is CopyReason.DATA_NOT_STREAMING, message="data-not-streaming")
    assert sources.changed.is_set()
    assert sources.view().copies["blog"].healthy

    # Streaming again.
    instance.status = {**instance.status, "isWalReceiverActive": True}
    await wait_for(lambda: shop_reason() is CopyReason.OK, message="healthy again")

    # The status endpoint fails past the grace period: unknown data counts as not streaming.
    instance.fail_with = 503
    await wait_for(lambda: shop_reason() is CopyReason.DATA_NOT_STREAMING, message="status unavailable")
    assert "unavailable" in sources.view().bindings[0].detail
    instance.fail_with = None
    await wait_for(lambda: shop_reason() is CopyReason.OK)

    # The binding goes away: no data condition any more.
    fake.delete(CNPG_CLUSTERS, "projects", "shop-db")
    await wait_for(lambda: sources.view().bindings == (), message="binding gone")
    assert shop_reason() is CopyReason.OK

    # The Service goes away.
    fake.delete(KNATIVE_SERVICES, "projects", "shop")
    await wait_for(lambda: "shop" not in sources.view().copies, message="copy gone")


async def test_copies_wait_for_the_cluster_cache(
    fake: FakeKubeApi, api: Any, instance: FakeCnpgInstance, running: list[asyncio.Task[None]]
) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    fake.fail_lists(500, times=1000, resource=CNPG_CLUSTERS)  # Services list fine, Clusters do not
    sources = KubeSources(api=api, settings=settings_for(instance), registry=CollectorRegistry())
    start(sources, running)
    await wait_for(
        lambda: sources.services.synced.is_set() and sources.view().watch_errors != (),
        message="services synced, cluster watch failing",
    )
    view = sources.view()
    assert not view.synced
    assert view.copies["shop"].reason is CopyReason.CACHE_NOT_SYNCED
    assert "clusters.postgresql.cnpg.io" in view.watch_errors[0]


async def test_without_cnpg_there_is_no_data_condition(
    fake: FakeKubeApi, api: Any, instance: FakeCnpgInstance, running: list[asyncio.Task[None]]
) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    settings = settings_for(instance, enabled=False)
    sources = KubeSources(api=api, settings=settings, registry=CollectorRegistry())
    assert sources.clusters is None and sources.cnpg is None
    start(sources, running)
    assert [task.get_name() for task in running] == ["kube-watch knative-services"]
    await wait_for(lambda: sources.view().synced, message="synced")
    assert sources.view().copies["shop"].healthy and sources.view().bindings == ()
