"""Observations beside the store: combined on read, never written into it."""

from __future__ import annotations

import time

import pytest

from region_agent.globaldns.compiler import ZoneConfig, compile_zone
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, Region, copy_key, project_key, region_key
from region_agent.state.observations import CombinedCopies, Observations, ObservedState, combine
from region_agent.state.store import Store

UP, DOWN = CopyHealth(True), CopyHealth(False, "check failed: 10.0.0.1: http 503", ("10.0.0.1",))


@pytest.mark.parametrize(("reported", "observed", "expected"), [
    (None, None, None),
    (UP, None, UP),
    (None, DOWN, DOWN),
    (UP, DOWN, DOWN),
    (CopyHealth(False, "no-ready-revision"), UP, CopyHealth(False, "no-ready-revision")),
    (CopyHealth(True, "ok", ("a",)), CopyHealth(True, "ok", ("b", "a")), CopyHealth(True, "ok", ("a", "b"))),
])
def test_the_owner_and_the_observer_must_both_say_healthy(
    reported: CopyHealth | None, observed: CopyHealth | None, expected: CopyHealth | None
) -> None:
    assert combine(reported, observed) == expected


def test_combined_copies_is_a_mapping_of_the_union() -> None:
    copies = CombinedCopies({("shop", "sfo1"): UP}, {("shop", "sfo1"): DOWN, ("shop", "ams1"): UP})
    assert len(copies) == 2 and set(copies) == {("shop", "sfo1"), ("shop", "ams1")}
    assert copies[("shop", "sfo1")] == DOWN and copies.get(("blog", "sfo1")) is None
    with pytest.raises(KeyError):
        copies[("blog", "sfo1")]


def test_observations_notify_only_on_change_and_forget() -> None:
    observations = Observations()
    heard: list[list[tuple[str, str]]] = []
    observations.subscribe(heard.append)
    assert observations.put(("shop", "sfo1"), UP)
    assert not observations.put(("shop", "sfo1"), CopyHealth(True))
    observations.forget([("shop", "sfo1"), ("blog", "sfo1")])
    assert heard == [[("shop", "sfo1")], [("shop", "sfo1")]]
    assert observations.get(("shop", "sfo1")) is None


def test_an_observed_failure_changes_answers_not_the_store_or_the_serial() -> None:
    store = Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    store.put(region_key("sfo1"), Region("sfo1", ipv4=("10.0.0.1",)))
    store.put(region_key("ams1"), Region("ams1", ipv4=("10.0.0.2",)))
    store.put(project_key("shop"), Project("shop", ("sfo1", "ams1"), primary="sfo1"))
    store.put(copy_key("shop", "sfo1"), UP)
    observations = Observations()
    view = ObservedState(store, observations)
    config = ZoneConfig(apex="g.example.com")
    before = compile_zone(view, config)
    digest = store.digest()
    observations.put(("shop", "sfo1"), DOWN)
    observations.put(("shop", "ams1"), UP)
    after = compile_zone(view, config)
    assert store.digest() == digest and after.serial == before.serial
    shop = next(r for r in after.description if r.get("name") == "shop.g.example.com")
    assert shop != next(r for r in before.description if r.get("name") == "shop.g.example.com")
    answers = shop["answers"]
    assert isinstance(answers, dict) and answers["A"]["addresses"] == ["10.0.0.2"]
