"""Pod JSON → MeteredPod, and Kubernetes quantities, as tables."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from region_agent.kube.quantity import QuantityError, millicores, parse_quantity, whole_units
from region_agent.usage.pods import PodFormatError, metered_pod_from_api, parse_time, pod_selectors
from region_agent.usage.sessions import run_of
from region_agent.usage.settings import UsageSettings
from tests.usage.factory import pod, running, terminated, ts, up, waiting

SETTINGS = UsageSettings()


@pytest.mark.parametrize(("text", "value"), [
    ("250m", Decimal("0.25")), ("1", Decimal(1)), ("0.5", Decimal("0.5")), ("1.5", Decimal("1.5")),
    ("128Mi", Decimal(128 * 2**20)), ("1Gi", Decimal(2**30)), ("500M", Decimal(500 * 10**6)),
    ("1e3", Decimal(1000)), ("1E-3", Decimal("0.001")), ("100k", Decimal(100_000)), ("2Ti", Decimal(2 * 2**40)),
    ("100n", Decimal("1e-7")), ("5u", Decimal("5e-6")), (2, Decimal(2)), (" 3 ", Decimal(3)),
])
def test_parse_quantity(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1Zi", "1.2.3", "m", "--1"])
def test_parse_quantity_rejects(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


@pytest.mark.parametrize(("text", "millis"), [("250m", 250), ("0.1", 100), ("1", 1000), ("1500u", 2), ("2", 2000)])
def test_millicores_round_up(text: str, millis: int) -> None:
    assert millicores(text) == millis


def test_whole_units() -> None:
    assert whole_units("1Gi") == 2**30
    assert whole_units("1.5") == 2


@pytest.mark.parametrize(("obj", "expect"), [
    (pod(statuses=None, phase="Pending"), {"cpu": 525, "memory": 306 * 2**20, "extended": ()}),
    (pod(requests=[{"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "2"}, {"cpu": "25m", "memory": "40Mi"}]),
     {"cpu": 1025, "memory": 2**30 + 40 * 2**20, "extended": (("nvidia.com/gpu", 2),)}),
    # Limits only (an object that skipped apiserver defaulting): requests default to limits.
    (pod(requests=[{}, {}], limits=[{"cpu": "2", "memory": "1Gi", "amd.com/gpu": "1"}, {"cpu": "100m"}]),
     {"cpu": 2100, "memory": 2**30, "extended": (("amd.com/gpu", 1),)}),
    # Native sidecars count; ordinary init containers (4 CPU here) do not; RuntimeClass overhead does.
    (pod(sidecars=[{"cpu": "100m", "memory": "64Mi"}], overhead={"cpu": "50m", "memory": "10Mi"}),
     {"cpu": 675, "memory": (256 + 50 + 64 + 10) * 2**20, "extended": ()}),
    # hugepages and ephemeral storage are not billed dimensions here.
    (pod(requests=[{"cpu": "1", "memory": "1Gi", "hugepages-2Mi": "4Mi", "ephemeral-storage": "1Gi"}]),
     {"cpu": 1000, "memory": 2**30, "extended": ()}),
])
def test_size(obj: dict[str, Any], expect: dict[str, Any]) -> None:
    size = metered_pod_from_api(obj, SETTINGS).size
    assert (size.cpu_millis, size.memory_bytes, size.extended) == (expect["cpu"], expect["memory"], expect["extended"])


@pytest.mark.parametrize(("annotations", "min_scale"), [
    ({}, 0), ({"autoscaling.knative.dev/min-scale": "3"}, 3), ({"autoscaling.knative.dev/minScale": "1"}, 1),
    ({"autoscaling.knative.dev/min-scale": "junk"}, 0), ({"autoscaling.knative.dev/min-scale": "-2"}, 0),
])
def test_min_scale(annotations: dict[str, str], min_scale: int) -> None:
    ident = metered_pod_from_api(pod(annotations=annotations), SETTINGS).identity
    assert ident.min_scale == min_scale
    assert ident.always_on is (min_scale >= 1)


def test_identity_and_slug_label() -> None:
    obj = pod(labels={"example.com/project": "shop-eu"}, service="shop-svc", revision="shop-svc-00002",
              namespace="p-shop")
    plain = metered_pod_from_api(obj, SETTINGS).identity
    assert (plain.slug, plain.service, plain.revision, plain.namespace) == (
        "shop-svc", "shop-svc", "shop-svc-00002", "p-shop")
    labelled = metered_pod_from_api(obj, UsageSettings(slug_label="example.com/project")).identity
    assert labelled.slug == "shop-eu"


@pytest.mark.parametrize(("obj", "running_since"), [
    (pod(statuses=None, phase="Pending"), None),
    (up(100), 100),
    (pod(statuses=[running(100), running(104)]), 104),  # the run starts when the last container is up
    (pod(statuses=[running(100)]), None),  # the second container has no status yet
    (pod(statuses=[waiting(), running(100)]), None),
    (pod(phase="Succeeded", statuses=[terminated(120), terminated(121)]), None),
    (pod(phase="Unknown", statuses=[running(100), running(100)]), None),
])
def test_running(obj: dict[str, Any], running_since: int | None) -> None:
    run = run_of(metered_pod_from_api(obj, SETTINGS))
    assert (None if run is None else run.since) == running_since


def test_container_times_and_deletion() -> None:
    obj = pod(statuses=[running(300, restarts=2, last_finished=290), terminated(310, started=100)], deletion=400,
              not_ready_since=305)
    p = metered_pod_from_api(obj, SETTINGS)
    first, second = p.containers
    assert (first.running, first.running_since, first.last_terminated_at, first.restarts) == (True, 300, 290, 2)
    assert (second.running, second.terminated_at) == (False, 310)
    assert (p.deletion_at, p.not_ready_since) == (400, 305)


def test_malformed_pod() -> None:
    obj = pod()
    del obj["metadata"]["uid"]
    with pytest.raises(PodFormatError):
        metered_pod_from_api(obj, SETTINGS)
    with pytest.raises(PodFormatError):
        metered_pod_from_api(pod(requests=[{"cpu": "lots"}]), SETTINGS)


def test_parse_time() -> None:
    assert parse_time(ts(1_800_000_000)) == 1_800_000_000
    assert parse_time("2027-01-15T08:00:00.999999Z") == parse_time("2027-01-15T08:00:00Z")
    assert parse_time("") is None and parse_time(None) is None and parse_time("yesterday") is None


def test_selectors() -> None:
    assert pod_selectors(SETTINGS, "node-7") == ("serving.knative.dev/service", "spec.nodeName=node-7")
