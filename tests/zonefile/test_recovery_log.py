"""A fixed zone file after a refused one is logged once, at info ("... usable again"), beside the apply line."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from region_agent.state.hlc import HybridClock
from region_agent.state.store import Store
from region_agent.zonefile.watcher import ZoneFileWatcher
from tests.zonefile.test_zonefile import GOOD


async def test_a_fixed_zone_file_is_logged_once_as_usable_again(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "zone.yaml"
    path.write_text(GOOD)
    store = Store(writer="standalone/n1", clock=HybridClock(lambda: int(time.time() * 1000)))
    watcher = ZoneFileWatcher(path, store, CollectorRegistry(), poll_interval=60, settle=0)
    await watcher.load()
    path.write_text("regions: [not, a, mapping\n")
    await watcher._poll(False)
    assert watcher.problems() and watcher.problem is not None
    caplog.clear()
    path.write_text(GOOD + "  x: {regions: [sfo1]}\n")
    await watcher._poll(False)
    await watcher._poll(False)   # nothing changed since: no second line
    assert watcher.problems() == ()
    recovered = [r for r in caplog.records if "usable again" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in recovered] == [(logging.INFO, f"zone file {path} usable again")]
