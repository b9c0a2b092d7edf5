"""The informer against the fake apiserver, through the real kubernetes_asyncio client over HTTP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from region_agent.kube.cache import WatchEvent
from region_agent.kube.errors import MalformedObjectError
from region_agent.kube.models import KnativeService
from region_agent.kube.resources import KNATIVE_SERVICES, PODS
from region_agent.kube.watch import Informer
from region_agent.usage.pods import pod_converter
from region_agent.usage.settings import UsageSettings
from tests.conftest import wait_for
from tests.fakes.kube_api import FakeKubeApi
from tests.fakes.kube_objects import knative_service, pod
from tests.kube.conftest import FAST_WATCH, InformerFactory


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def recorder(informer: Informer[Any]) -> list[WatchEvent[Any]]:
    events: list[WatchEvent[Any]] = []
    informer.add_handler(events.append)
    return events


async def test_lists_then_streams_changes(fake: FakeKubeApi, start_informer: InformerFactory) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    informer = await start_informer()
    events = recorder(informer)
    assert set(informer.items) == {"projects/shop"}
    assert informer.items["projects/shop"].latest_ready_revision == "shop-00001"
    await wait_for(lambda: fake.open_watches == 1, message="watch open")

    fake.put(KNATIVE_SERVICES, knative_service("blog"))
    fake.put(KNATIVE_SERVICES, knative_service("shop", latest_ready="shop-00002", generation=2))
    fake.delete(KNATIVE_SERVICES, "projects", "blog")

    await wait_for(lambda: len(events) == 3, message="three events")
    assert [(e.type, e.key) for e in events] == [
        ("ADDED", "projects/blog"),
        ("MODIFIED", "projects/shop"),
        ("DELETED", "projects/blog"),
    ]
    assert events[1].old is not None and events[1].old.latest_ready_revision == "shop-00001"
    assert events[1].obj.latest_ready_revision == "shop-00002"
    assert not any(e.final_state_unknown for e in events)
    assert informer.resource_version == fake.resource_version


async def test_watch_starts_from_the_lists_resource_version(fake: FakeKubeApi, start_informer: InformerFactory) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    await start_informer()
    await wait_for(lambda: fake.watch_requests(KNATIVE_SERVICES), message="watch request")
    first_list = fake.list_requests(KNATIVE_SERVICES)[0]
    assert first_list["resourceVersion"] == "0" and "resourceVersionMatch" not in first_list
    watch = fake.watch_requests(KNATIVE_SERVICES)[0]
    assert watch["resourceVersion"] == fake.resource_version
    assert watch["allowWatchBookmarks"] == "true"
    assert watch["timeoutSeconds"] == "30"


async def test_modification_of_fields_not_kept_emits_nothing(
    fake: FakeKubeApi, start_informer: InformerFactory
) -> None:
    service = knative_service("shop")
    fake.put(KNATIVE_SERVICES, service)
    informer = await start_informer()
    events = recorder(informer)
    await wait_for(lambda: fake.open_watches == 1)
    service["metadata"]["annotations"]["unrelated"] = "changed"
    fake.put(KNATIVE_SERVICES, service)
    fake.put(KNATIVE_SERVICES, knative_service("marker"))
    await wait_for(lambda: len(events) == 1)
    assert events[0].key == "projects/marker"  # the annotation-only change was swallowed
    assert informer.resource_version == fake.resource_version


async def test_pagination_reads_every_page_at_one_version(fake: FakeKubeApi, start_informer: InformerFactory) -> None:
    for index in range(7):
        fake.put(KNATIVE_SERVICES, knative_service(f"svc{index}"))
    informer = await start_informer(settings=FAST_WATCH.model_copy(update={"page_size": 3}))
    assert len(informer.items) == 7
    lists = fake.list_requests(KNATIVE_SERVICES)
    assert [q.get("limit") for q in lists] == ["3", "3", "3"]
    assert "continue" not in lists[0] and all("continue" in q for q in lists[1:])
    assert all("resourceVersion" not in q for q in lists[1:])  # forbidden together with continue


async def test_expired_continue_token_restarts_the_list_as_a_consistent_read(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    for index in range(5):
        fake.put(KNATIVE_SERVICES, knative_service(f"svc{index}"))
    fake.expire_next_continue()
    informer = await start_informer(settings=FAST_WATCH.model_copy(update={"page_size": 2}))
    assert len(informer.items) == 5
    lists = fake.list_requests(KNATIVE_SERVICES)
    # page 1 (rv=0), page 2 -> 410, restart without resourceVersion, then its pages
    assert lists[0]["resourceVersion"] == "0"
    assert "continue" in lists[1]
    assert "resourceVersion" not in lists[2] and "continue" not in lists[2]
    assert metric(registry, "region_agent_kube_relists_total", resource=informer.name, reason="continue-expired") == 1


async def test_bookmarks_advance_the_resource_version(fake: FakeKubeApi, start_informer: InformerFactory) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    informer = await start_informer()
    await wait_for(lambda: fake.open_watches == 1)
    fake.put(PODS, pod("unrelated"))  # moves the global resourceVersion without a Service event
    fake.bookmark()
    await wait_for(lambda: informer.resource_version == fake.resource_version, message="bookmark applied")
    assert len(informer.items) == 1

    fake.drop_watches()
    await wait_for(lambda: len(fake.watch_requests(KNATIVE_SERVICES)) == 2, message="re-watch")
    assert fake.watch_requests(KNATIVE_SERVICES)[1]["resourceVersion"] == fake.resource_version


async def test_watch_reconnects_after_a_dropped_connection_without_relisting(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    informer = await start_informer()
    events = recorder(informer)
    await wait_for(lambda: fake.open_watches == 1)
    fake.drop_watches()
    fake.put(KNATIVE_SERVICES, knative_service("after-drop"))
    await wait_for(lambda: "projects/after-drop" in informer.items, message="event after reconnect")
    assert [e.type for e in events] == ["ADDED"]
    assert len(fake.list_requests(KNATIVE_SERVICES)) == 1
    assert metric(registry, "region_agent_kube_watch_errors_total", resource=informer.name, reason="stream") >= 1


async def test_half_open_watch_is_abandoned_after_the_read_deadline(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    settings = FAST_WATCH.model_copy(update={"server_timeout_min": 1, "server_timeout_max": 1, "read_margin": 0.3})
    fake.stall_watches()
    informer = await start_informer(settings=settings)
    await wait_for(
        lambda: metric(registry, "region_agent_kube_watch_errors_total", resource=informer.name, reason="timeout") >= 1,
        timeout=5,
        message="read timeout",
    )
    assert informer.error is not None and "timeout" in informer.error
    fake.stall_watches(False)
    fake.put(KNATIVE_SERVICES, knative_service("after-stall"))
    await wait_for(lambda: "projects/after-stall" in informer.items, timeout=5, message="recovered")
    await wait_for(lambda: informer.error is None)


async def test_server_timeout_ends_the_watch_and_it_is_resumed(
    fake: FakeKubeApi, start_informer: InformerFactory
) -> None:
    settings = FAST_WATCH.model_copy(update={"server_timeout_min": 1, "server_timeout_max": 1})
    informer = await start_informer(settings=settings)
    await wait_for(lambda: len(fake.watch_requests(KNATIVE_SERVICES)) >= 2, timeout=5, message="second watch")
    assert len(fake.list_requests(KNATIVE_SERVICES)) == 1
    assert informer.error is None


async def test_410_in_the_stream_relists_at_the_last_version(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    informer = await start_informer()
    await wait_for(lambda: fake.open_watches == 1)
    last_seen = informer.resource_version
    fake.send_error(410)
    await wait_for(lambda: len(fake.list_requests(KNATIVE_SERVICES)) == 2, message="relist")
    relist = fake.list_requests(KNATIVE_SERVICES)[1]
    assert relist["resourceVersion"] == last_seen and relist["resourceVersionMatch"] == "NotOlderThan"
    assert metric(registry, "region_agent_kube_relists_total", resource=informer.name, reason="expired") == 1
    assert set(informer.items) == {"projects/shop"}


async def test_service_deleted_while_disconnected_comes_out_as_deleted_after_relist(
    fake: FakeKubeApi, start_informer: InformerFactory
) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    fake.put(KNATIVE_SERVICES, knative_service("blog"))
    informer = await start_informer()
    events = recorder(informer)
    await wait_for(lambda: fake.open_watches == 1)

    fake.refuse_watches(503)
    fake.drop_watches()
    fake.delete(KNATIVE_SERVICES, "projects", "shop")
    fake.put(KNATIVE_SERVICES, knative_service("blog", latest_ready="blog-00002", generation=2))
    fake.expire_history()  # the events above are gone: only a relist can tell
    await wait_for(lambda: len(fake.watch_requests(KNATIVE_SERVICES)) >= 3, message="refused re-watches")
    fake.refuse_watches(None)

    await wait_for(lambda: "projects/shop" not in informer.items, message="relisted")
    deleted = [e for e in events if e.type == "DELETED"]
    assert len(deleted) == 1 and deleted[0].key == "projects/shop" and deleted[0].final_state_unknown
    assert deleted[0].obj.name == "shop"
    modified = [e for e in events if e.type == "MODIFIED"]
    assert [e.obj.latest_ready_revision for e in modified] == ["blog-00002"]


async def test_410_as_http_status_on_watch_relists(fake: FakeKubeApi, start_informer: InformerFactory) -> None:
    fake.watch_expired_as_http_status = True
    informer = await start_informer()
    await wait_for(lambda: fake.open_watches == 1)
    fake.refuse_watches(503)
    fake.drop_watches()
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    fake.expire_history()
    fake.refuse_watches(None)
    await wait_for(lambda: "projects/shop" in informer.items, message="relisted after HTTP 410")
    assert len(fake.list_requests(KNATIVE_SERVICES)) == 2


async def test_410_on_list_falls_back_to_a_consistent_list(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    informer = await start_informer()
    await wait_for(lambda: fake.open_watches == 1)
    fake.fail_lists(410)
    fake.send_error(410)  # watch expired -> relist at the last version -> 410 -> consistent list
    await wait_for(lambda: len(fake.list_requests(KNATIVE_SERVICES)) == 3, message="consistent relist")
    lists = fake.list_requests(KNATIVE_SERVICES)
    assert lists[1]["resourceVersionMatch"] == "NotOlderThan"
    assert "resourceVersion" not in lists[2]
    assert metric(registry, "region_agent_kube_relists_total", resource=informer.name, reason="list-expired") == 1
    await wait_for(lambda: fake.open_watches == 1, message="watching again")


async def test_cache_not_synced_while_lists_fail(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    fake.fail_lists(500, times=3)
    informer = await start_informer(wait_synced=False)
    states: list[tuple[bool, str | None, float]] = []
    informer.add_state_listener(
        lambda: states.append(
            (
                informer.synced.is_set(),
                informer.error,
                metric(registry, "region_agent_kube_synced", resource=informer.name),
            )
        )
    )
    await wait_for(informer.synced.is_set, message="synced after the failures")
    assert states[0][0] is False and "http-500" in (states[0][1] or "") and states[0][2] == 0
    assert metric(registry, "region_agent_kube_synced", resource=informer.name) == 1
    assert informer.error is None and informer.synced_at is not None
    assert metric(registry, "region_agent_kube_watch_errors_total", resource=informer.name, reason="http-500") == 3


async def test_selectors_are_sent_and_objects_leaving_them_are_deleted(
    fake: FakeKubeApi, start_informer: InformerFactory
) -> None:
    fake.put(PODS, pod("here", node="node-a"))
    fake.put(PODS, pod("elsewhere", node="node-b"))
    fake.put(PODS, pod("not-knative", node="node-a", labels={"app": "x"}))
    informer = await start_informer(
        resource=PODS,
        convert=pod_converter(UsageSettings()),
        label_selector="serving.knative.dev/service",
        field_selector="spec.nodeName=node-a",
        name="node-pods",
    )
    events = recorder(informer)
    assert set(informer.items) == {"projects/here"}
    await wait_for(lambda: fake.open_watches == 1)
    watch = fake.watch_requests(PODS)[0]
    assert watch["fieldSelector"] == "spec.nodeName=node-a"
    assert watch["labelSelector"] == "serving.knative.dev/service"

    fake.put(PODS, pod("here", node="node-a", labels={"app": "relabelled"}))
    fake.put(PODS, pod("new", node="node-a"))
    await wait_for(lambda: len(events) == 2)
    assert [(e.type, e.key) for e in events] == [("DELETED", "projects/here"), ("ADDED", "projects/new")]


async def test_malformed_input_is_skipped_and_counted(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    def picky(obj: Mapping[str, Any]) -> KnativeService:
        if obj.get("metadata", {}).get("labels", {}).get("broken"):
            raise MalformedObjectError("broken on purpose")
        return KnativeService.from_api(obj)

    fake.put(KNATIVE_SERVICES, knative_service("bad-in-list", labels={"broken": "yes"}))
    fake.put(KNATIVE_SERVICES, knative_service("good"))
    informer = await start_informer(convert=picky)
    assert set(informer.items) == {"projects/good"}
    await wait_for(lambda: fake.open_watches == 1)

    fake.send_raw(b"{not json")
    fake.send_raw(b'{"type": "ADDED"}')
    fake.send_raw(b'{"type": "ADDED", "object": {"metadata": {}}}')
    fake.send_raw(b'{"type": "SURPRISE", "object": {"metadata": {"name": "x"}}}')
    fake.put(KNATIVE_SERVICES, knative_service("bad-in-watch", labels={"broken": "yes"}))
    fake.put(KNATIVE_SERVICES, knative_service("after"))
    await wait_for(lambda: "projects/after" in informer.items, message="still watching")
    assert "projects/bad-in-watch" not in informer.items
    assert metric(registry, "region_agent_kube_malformed_objects_total", resource=informer.name) == 6
    assert len(fake.list_requests(KNATIVE_SERVICES)) == 1


async def test_a_failing_handler_does_not_stop_the_informer(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    informer = await start_informer()

    def explode(event: WatchEvent[Any]) -> None:
        raise RuntimeError("handler bug")

    informer.add_handler(explode)
    events = recorder(informer)
    await wait_for(lambda: fake.open_watches == 1)
    fake.put(KNATIVE_SERVICES, knative_service("one"))
    fake.put(KNATIVE_SERVICES, knative_service("two"))
    await wait_for(lambda: len(events) == 2)
    assert metric(registry, "region_agent_kube_handler_errors_total", resource=informer.name) == 2


async def test_very_short_watches_are_backed_off(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    fake.end_watches_at_once()
    settings = FAST_WATCH.model_copy(update={"very_short_watch": 5.0, "backoff_initial": 0.05, "backoff_cap": 0.2})
    informer = await start_informer(settings=settings)
    await wait_for(
        lambda: (
            metric(registry, "region_agent_kube_watch_errors_total", resource=informer.name, reason="very-short-watch")
            >= 3
        ),
        timeout=5,
        message="very short watches",
    )
    assert informer.error is not None and "very-short-watch" in informer.error


async def test_metrics_describe_the_cache(
    fake: FakeKubeApi, start_informer: InformerFactory, registry: CollectorRegistry
) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    informer = await start_informer(name="services")
    await wait_for(lambda: fake.open_watches == 1)
    fake.put(KNATIVE_SERVICES, knative_service("blog"))
    await wait_for(lambda: len(informer.items) == 2)
    assert metric(registry, "region_agent_kube_objects", resource="services") == 2
    assert metric(registry, "region_agent_kube_synced", resource="services") == 1
    assert metric(registry, "region_agent_kube_events_total", resource="services", type="ADDED") == 1
    assert metric(registry, "region_agent_kube_relists_total", resource="services", reason="initial") == 1
    assert metric(registry, "region_agent_kube_last_event_timestamp_seconds", resource="services") > 0
    assert informer.last_event_at is not None
