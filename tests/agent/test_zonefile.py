"""The standalone zone file: validation naming the field, replace semantics, reload rules."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.state.hlc import HybridClock
from agent.state.model import CopyHealth, Project, copy_key, project_key, region_key
from agent.state.store import Store
from agent.zonefile import ZoneFileError, ZoneFileWatcher, apply_zone_data, parse_zone_data, read_zone_file
from tests.conftest import wait_for

GOOD = """
regions:
  sfo1: {ipv4: [192.0.2.11], ns_ipv4: [192.0.2.53], latitude: 37.6, longitude: -122.4}
  ams1: {ipv4: [192.0.2.12]}
projects:
  shop: {regions: [sfo1, ams1], primary: sfo1}
  blog: {regions: [ams1], mode: proximity, all_down: servfail}
"""


def _store() -> Store:
    return Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))


def test_good_file(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text(GOOD)
    data = read_zone_file(path)
    assert set(data.regions) == {"sfo1", "ams1"}
    assert data.projects["shop"].groups == (("sfo1",), ("ams1",))
    assert data.projects["blog"].all_down.value == "servfail"


@pytest.mark.parametrize(("text", "message"), [
    ("regions: [1, 2]", "regions"),
    ("regions:\n  SFO: {}\n", "region name"),
    ("regions:\n  sfo1: {ipv4: [300.1.1.1]}\n", "not an IP address"),
    ("regions:\n  sfo1: {ipv4: [192.0.2.1], colour: blue}\n", "regions.sfo1.colour"),
    ("projects:\n  shop: {regions: [sfo1]}\n", "unknown region(s) sfo1"),
    ("regions: {sfo1: {}}\nprojects:\n  shop: {regions: [sfo1], mode: fastest}\n", "projects.shop.mode"),
    ("regions: {sfo1: {}}\nprojects:\n  Shop: {regions: [sfo1]}\n", "slug"),
    ("regions: {sfo1: {}}\nprojects:\n  shop: {regions: [sfo1], all_down: maybe}\n", "projects.shop.all_down"),
    ("[", "not valid YAML"),
    ("- a\n- b\n", "must be a mapping"),
])
def test_bad_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text(text)
    with pytest.raises(ZoneFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_zone_file(path)


def test_missing_file() -> None:
    with pytest.raises(ZoneFileError, match="No such file"):
        read_zone_file(Path("/nonexistent/zone.yaml"))


def test_apply_replaces_regions_and_projects_and_drops_stale_copies() -> None:
    store = _store()
    assert apply_zone_data(store, parse_zone_data({"regions": {"sfo1": {}, "ams1": {}},
                                                   "projects": {"shop": {"regions": ["sfo1", "ams1"]}}})) == 3
    store.put(copy_key("shop", "ams1"), CopyHealth(True))
    assert apply_zone_data(store, parse_zone_data({"regions": {"sfo1": {}, "ams1": {}},
                                                   "projects": {"shop": {"regions": ["sfo1", "ams1"]}}})) == 0
    apply_zone_data(store, parse_zone_data({"regions": {"sfo1": {}},
                                            "projects": {"shop": {"regions": ["sfo1"]}}}))
    assert store.get(region_key("ams1")) is None
    assert store.get(copy_key("shop", "ams1")) is None
    assert store.get(project_key("shop")) == Project("shop", ("sfo1",))


async def test_watcher_applies_changes_and_keeps_the_old_zone_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text(GOOD)
    store = _store()
    watcher = ZoneFileWatcher(path, store, CollectorRegistry(), poll_interval=0.05)
    watcher.load()
    task = asyncio.create_task(watcher.run())
    try:
        path.write_text(GOOD + "  extra: {regions: [sfo1]}\n")
        await wait_for(lambda: store.get(project_key("extra")) is not None, timeout=3, message="extra added")
        path.write_text("projects: {broken: {regions: [nowhere]}}\n")
        await wait_for(lambda: watcher.errors._value.get() == 1, timeout=3, message="error counted")
        assert store.get(project_key("extra")) is not None  # the old zone stays
        assert store.get(project_key("broken")) is None
        watcher.request_reload()  # SIGHUP forces a read even when the file did not change
        await wait_for(lambda: watcher.errors._value.get() == 2, timeout=3, message="forced re-read")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
