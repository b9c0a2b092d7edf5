"""The standalone zone file: refusal rules naming the problem, replace semantics, reload rules."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from region_agent.cli.main import main as cli_main
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, copy_key, project_key, region_key
from region_agent.state.store import Entry, Store
from region_agent.zonefile.watcher import (
    FileContent,
    ZoneFileError,
    ZoneFileWatcher,
    apply_zone_data,
    parse_zone_data,
    read_zone_file,
)
from tests.conftest import wait_for

GOOD = """
regions:
  sfo1: {ipv4: [192.0.2.11], ns_ipv4: [192.0.2.53], latitude: 37.6, longitude: -122.4}
  ams1: {ipv4: [192.0.2.12]}
projects:
  shop: {regions: [sfo1, ams1], primary: sfo1}
  blog: {regions: [ams1], mode: proximity, all_down: servfail}
"""


def _zone(projects: int, regions: str = "sfo1") -> str:
    lines = ["regions:", "  sfo1: {ipv4: [192.0.2.11]}", "  ams1: {ipv4: [192.0.2.12]}", "projects:"]
    lines += [f"  p{i}: {{regions: [{regions}]}}" for i in range(projects)]
    return "\n".join(lines) + "\n"


Start = Callable[..., Awaitable[ZoneFileWatcher]]


def _store() -> Store:
    return Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))


def _errors(watcher: ZoneFileWatcher, reason: str) -> float:
    return float(watcher.errors.labels(reason)._value.get())


def _reloads(watcher: ZoneFileWatcher) -> float:
    return float(watcher.reloads._value.get())


def test_good_file(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text(GOOD)
    data = read_zone_file(path)
    assert set(data.regions) == {"sfo1", "ams1"}
    assert data.projects["shop"].groups == (("sfo1",), ("ams1",))
    assert data.projects["blog"].all_down.value == "servfail"
    assert data.projects["shop"].partition is None


def test_a_project_may_name_its_partition_policy(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text("regions: {sfo1: {}, ams1: {}}\nprojects:\n  shop: {regions: [sfo1, ams1], partition: failover}\n")
    assert read_zone_file(path).projects["shop"].partition == "failover"
    path.write_text("regions: {sfo1: {}}\nprojects:\n  shop: {regions: [sfo1], partition: sometimes}\n")
    with pytest.raises(ZoneFileError, match="partition"):
        read_zone_file(path)


BAD_FILES = [
    (b"regions: [1, 2]", "invalid", "regions"),
    (b"regions:\n  SFO: {}\n", "invalid", "region name"),
    (b"regions:\n  sfo1: {ipv4: [300.1.1.1]}\n", "invalid", "not an IP address"),
    (b"regions:\n  abc" + b"1" * 58 + b": {ns_ipv4: [192.0.2.53]}\n", "invalid", "61 characters, at most 60"),
    (b"regions:\n  sfo1: {ipv4: [0.0.0.0]}\n", "invalid", "sfo1.ipv4: 0.0.0.0 is the unspecified address"),
    (b"regions:\n  sfo1: {ns_ipv4: [224.0.0.53]}\n", "invalid", "sfo1.ns_ipv4: 224.0.0.53 is a multicast address"),
    (b"regions:\n  sfo1: {ns_ipv6: [ff02::1]}\n", "invalid", "sfo1.ns_ipv6: ff02::1 is a multicast address"),
    (b"regions:\n  sfo1: {ipv4: [192.0.2.1], colour: blue}\n", "invalid", "regions.sfo1.colour"),
    (b"regions: {ams1: {}}\nprojects:\n  shop: {regions: [sfo1]}\n", "invalid", "unknown region(s) sfo1"),
    (b"regions: {sfo1: {}}\nprojects:\n  shop: {regions: [sfo1], mode: fastest}\n", "invalid", "projects.shop.mode"),
    (b"regions: {sfo1: {}}\nprojects:\n  Shop: {regions: [sfo1]}\n", "invalid", "slug"),
    (b"regions: {sfo1: {}}\nprojects:\n  shop: {regions: [sfo1], all_down: maybe}\n", "invalid",
     "projects.shop.all_down"),
    (b"[", "yaml", "not valid YAML"),
    (b"- a\n- b\n", "invalid", "must be a mapping"),
    (b"", "empty", "the file is empty"),
    (b"\n  \n\t\n", "empty", "the file is empty"),
    (b"# regions:\n#   sfo1: {}\n", "empty", "no regions and no projects (empty, or only comments)"),
    (b"projects: {}\n", "no-regions", "no regions"),
    (b"regions: {}\nprojects: {}\n", "no-regions", "no regions"),
    (b"regions:\n  sfo1: {}\n# caf\xe9\n", "not-utf8", "not UTF-8: byte 0xe9 at line 3"),
    (b"\xff\xfe", "not-utf8", "not UTF-8: byte 0xff at line 1"),
    (b"regions: {sfo1: {}}\nprojects:\n  a: {regions: [sfo1]}\nprojects:\n  b: {regions: [sfo1]}\n",
     "duplicate-key", "duplicate key 'projects' at line 4 (first at line 2)"),
    (b"regions: {sfo1: {}}\nprojects:\n  a: {regions: [sfo1]}\n  b: {regions: [sfo1]}\n  a: {regions: [sfo1]}\n",
     "duplicate-key", "duplicate key 'a' at line 5 (first at line 3)"),
    (b"regions: {sfo1: {ipv4: [192.0.2.1], ipv4: [192.0.2.2]}}\n", "duplicate-key",
     "duplicate key 'ipv4' at line 1 (first at line 1)"),
]


@pytest.mark.parametrize(("content", "reason", "message"), BAD_FILES)
def test_bad_files_are_refused_naming_the_problem(tmp_path: Path, content: bytes, reason: str, message: str) -> None:
    path = tmp_path / "zone.yaml"
    path.write_bytes(content)
    with pytest.raises(ZoneFileError) as caught:
        read_zone_file(path)
    assert message in str(caught.value)
    assert str(path) in str(caught.value)
    assert caught.value.reason == reason


def test_check_config_refuses_a_region_too_long_for_a_dns_name_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_bytes(b"regions:\n  abc" + b"1" * 58 + b": {ipv4: [192.0.2.1], ns_ipv4: [192.0.2.53]}\n")
    assert cli_main(["check-config", "--zone-file", str(zone)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "at most 60" in lines[0] and str(zone) in lines[0]


def test_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text("regions:\n  sfo1: &r {ipv4: [192.0.2.1]}\n  ams1: {<<: *r, ipv4: [192.0.2.2]}\n")
    assert read_zone_file(path).regions["ams1"].ipv4 == ("192.0.2.2",)


def test_missing_file() -> None:
    with pytest.raises(ZoneFileError, match="No such file") as caught:
        read_zone_file(Path("/nonexistent/zone.yaml"))
    assert caught.value.reason == "io"


def test_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text(_zone(50))
    size = path.stat().st_size
    assert len(read_zone_file(path, max_bytes=size).projects) == 50
    with pytest.raises(ZoneFileError, match=f"{size} bytes, more than the limit of {size - 1}") as caught:
        read_zone_file(path, max_bytes=size - 1)
    assert caught.value.reason == "too-large"


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


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Start]:
    """Starts watchers on ``tmp_path/zone.yaml`` (after a good first load) and stops them."""
    tasks: list[asyncio.Task[None]] = []

    async def start(first: str = GOOD, **kwargs: object) -> ZoneFileWatcher:
        path = tmp_path / "zone.yaml"
        path.write_text(first)
        options: dict[str, object] = {"poll_interval": 0.02, "settle": 0.02, **kwargs}
        watcher = ZoneFileWatcher(path, _store(), CollectorRegistry(), **options)  # type: ignore[arg-type]
        await watcher.load()
        tasks.append(asyncio.create_task(watcher.run()))
        return watcher

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_bad_file_keeps_the_old_zone_and_the_watch_goes_on(running: Start) -> None:
    watcher = await running()
    path = watcher.path
    path.write_text(GOOD + "  extra: {regions: [sfo1]}\n")
    await wait_for(lambda: watcher.store.get(project_key("extra")) is not None, timeout=5, message="extra added")
    path.write_text("regions: {sfo1: {}}\nprojects: {broken: {regions: [nowhere]}}\n")
    await wait_for(lambda: _errors(watcher, "invalid") == 1, timeout=5, message="error counted")
    assert watcher.store.get(project_key("extra")) is not None  # the old zone stays
    assert watcher.store.get(project_key("broken")) is None
    assert watcher.problem is not None and "region name 'nowhere'" in watcher.problem
    watcher.request_reload()  # SIGHUP forces a read even when the file did not change
    await wait_for(lambda: _errors(watcher, "invalid") == 2, timeout=5, message="forced re-read")
    assert watcher.problems() == (f"zone file refused, serving the previous zone: {watcher.problem}",)
    path.write_text(GOOD)
    await wait_for(lambda: watcher.problem is None, timeout=5, message="fixed")
    assert watcher.problems() == ()


async def test_a_non_utf8_byte_is_refused_and_a_fixed_file_is_picked_up(
        running: Start) -> None:
    watcher = await running()
    watcher.path.write_bytes(GOOD.encode() + b"  caf\xe9: {regions: [sfo1]}\n")
    await wait_for(lambda: _errors(watcher, "not-utf8") == 1, timeout=5, message="decode error counted")
    assert set(watcher.store.projects) == {"shop", "blog"}
    watcher.path.write_text(GOOD + "  cafe: {regions: [sfo1]}\n")
    await wait_for(lambda: "cafe" in watcher.store.projects, timeout=5, message="fixed file applied")
    assert watcher.problem is None


@pytest.mark.parametrize(("content", "reason"), [
    (b"", "empty"),
    (b"# nothing here yet\n", "empty"),
    (b"projects: {}\n", "no-regions"),
    (b"regions: {sfo1: {}}\nregions: {ams1: {}}\n", "duplicate-key"),
])
async def test_a_file_that_would_empty_the_zone_is_refused(
        running: Start, content: bytes, reason: str) -> None:
    watcher = await running()
    watcher.path.write_bytes(content)
    await wait_for(lambda: _errors(watcher, reason) == 1, timeout=5, message=f"{reason} counted")
    assert set(watcher.store.projects) == {"shop", "blog"} and set(watcher.store.regions) == {"sfo1", "ams1"}


async def test_any_other_exception_is_counted_and_the_watch_goes_on(
        running: Start) -> None:
    calls = 0

    def override() -> bool:  # the second call (the first read after start) fails
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("boom")
        return False

    watcher = await running(GOOD, allow_mass_removal=override)
    watcher.path.write_text(GOOD + "  extra: {regions: [sfo1]}\n")
    await wait_for(lambda: _errors(watcher, "internal") == 1, timeout=5, message="internal error counted")
    await wait_for(lambda: "extra" in watcher.store.projects, timeout=5, message="applied on a later poll")


async def test_mass_removal_is_refused_until_the_override_is_set_and_sighup(
        running: Start) -> None:
    allowed = False
    watcher = await running(_zone(10), allow_mass_removal=lambda: allowed)
    watcher.path.write_text(_zone(5))  # half: allowed
    await wait_for(lambda: len(watcher.store.projects) == 5, timeout=5, message="half removed")
    watcher.path.write_text(_zone(2))  # 3 of 5
    await wait_for(lambda: _errors(watcher, "mass-removal") == 1, timeout=5, message="mass removal refused")
    assert watcher.problem is not None and "would remove 3 of 5 projects" in watcher.problem
    assert len(watcher.store.projects) == 5
    allowed = True  # the operator sets zone_file_allow_mass_removal and sends SIGHUP
    watcher.request_reload()
    await wait_for(lambda: len(watcher.store.projects) == 2, timeout=5, message="confirmed removal applied")
    assert _errors(watcher, "mass-removal") == 1


async def test_a_truncate_then_write_is_applied_only_once_stable(running: Start) -> None:
    watcher = await running(poll_interval=0.01, settle=0.05)
    reads: list[int] = []
    plain_read = watcher._read

    def read() -> tuple[FileContent, bool]:
        result = plain_read()
        reads.append(len(result[0].data))
        if result[0].data == b"":  # the writer finishes during the settle interval
            watcher.path.write_text(GOOD + "  later: {regions: [sfo1]}\n")
        return result

    watcher._read = read  # type: ignore[method-assign]
    watcher.path.write_text("")  # truncated
    await wait_for(lambda: "later" in watcher.store.projects, timeout=5, message="new content applied")
    assert reads[0] == 0  # the gap was read ...
    assert sum(_errors(watcher, r) for r in ("empty", "invalid", "yaml")) == 0  # ... and neither refused nor served
    assert set(watcher.store.projects) == {"shop", "blog", "later"}


async def test_unchanged_content_is_not_applied_again(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text(GOOD)
    watcher = ZoneFileWatcher(path, _store(), CollectorRegistry(), poll_interval=60, settle=0.01)
    await watcher.load()
    heard: list[list[Entry]] = []
    watcher.store.subscribe(heard.append)
    assert await watcher.check(forced=False) is False  # nothing changed on disk
    path.write_text(GOOD)  # same bytes, new mtime
    assert await watcher.check(forced=False) is False
    assert await watcher.check(forced=True) is False  # SIGHUP without a change
    path.write_text(GOOD + "  x: {regions: [sfo1]}\n")
    assert await watcher.check(forced=False) is True
    assert _reloads(watcher) == 2 and len(heard) == 1


async def test_a_reload_of_many_projects_notifies_listeners_once(running: Start) -> None:
    watcher = await running(_zone(1000))
    heard: list[list[Entry]] = []
    watcher.store.subscribe(heard.append)
    watcher.path.write_text(_zone(1000, regions="sfo1, ams1"))
    await wait_for(lambda: heard, timeout=10, message="reload")
    assert [len(batch) for batch in heard] == [1000]


async def test_a_stop_does_not_wait_for_a_parse_in_progress(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text(GOOD)
    release = threading.Event()
    reading = threading.Event()

    def slow_override() -> bool:  # runs in the read thread, like a long parse
        reading.set()
        release.wait(30)
        return False

    watcher = ZoneFileWatcher(path, _store(), CollectorRegistry(), poll_interval=60, settle=0,
                              allow_mass_removal=slow_override)
    task = asyncio.create_task(watcher.run())
    try:
        watcher.request_reload()
        await wait_for(reading.is_set, timeout=5, message="read thread busy")
        task.cancel()
        await wait_for(task.done, timeout=1, message="watch task cancelled while the thread still runs")
        assert task.cancelled() and not release.is_set()
    finally:
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
