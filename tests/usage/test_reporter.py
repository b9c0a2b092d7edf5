"""The reporter against the fake control plane: every fault, then the ledger of keys must match."""

from __future__ import annotations

import asyncio
import email.utils
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from region_agent.base.clock import ManualClock
from region_agent.usage.metrics import UsageMetrics
from region_agent.usage.pods import metered_pod_from_api
from region_agent.usage.records import Record, make_record
from region_agent.usage.reporter import Reporter, classify, parse_retry_after
from region_agent.usage.sessions import SessionBook
from region_agent.usage.settings import UsageSettings
from region_agent.usage.spool import Spool
from tests.fakes.control_plane import FakeControlPlane
from tests.usage.factory import up


def make_records(pods: int, slices: int = 1, *, region: str = "sfo1") -> list[Record]:
    """Valid records: ``pods`` pods, each billed in ``slices`` checkpoints of 60 s."""
    book = SessionBook()
    settings = UsageSettings()
    for i in range(pods):
        book.observe(metered_pod_from_api(up(1000, name=f"p{i}"), settings), 1001)
    out = []
    for n in range(1, slices + 1):
        out += [make_record(s, region=region, node="node-a") for s in book.checkpoint(1000 + 60 * n).slices]
    return out


@dataclass
class Harness:
    plane: FakeControlPlane
    spool: Spool
    reporter: Reporter
    delays: list[float] = field(default_factory=list)

    async def drain(self, *, max_posts: int = 200) -> None:
        """Run the reporter's send step until the spool has nothing unsent."""
        async with self.reporter._http() as http:
            for _ in range(max_posts):
                await self.reporter.report_once(http)
                if (await self.spool.stats()).unsent == 0 and not self.reporter._suspects:
                    return
        raise AssertionError(f"spool not drained after {max_posts} posts")


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    plane = FakeControlPlane(stall_for=0.5)
    await plane.start()
    spool = Spool(str(tmp_path / "usage.sqlite3"))
    await spool.open(region="sfo1", node="node-a")
    settings = UsageSettings(endpoint_url=plane.url, token="test-token", token_file=None, batch_size=10,
                             request_timeout=0.25)
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        await asyncio.sleep(0)

    reporter = Reporter(settings, spool, UsageMetrics.create(CollectorRegistry()), region="sfo1", node="node-a",
                        clock=ManualClock(), sleep=sleep)
    yield Harness(plane, spool, reporter, delays)
    plane.release()
    await spool.close()
    await plane.stop()


def assert_delivered_once(plane: FakeControlPlane, records: list[Record]) -> None:
    assert not plane.conflicts and not plane.malformed
    assert set(plane.records) == {r.key for r in records}
    assert plane.total_seconds == sum(r.seconds for r in records)
    assert not plane.overlaps()


@pytest.mark.parametrize("fault", ["fail-500", "fail-503", "throttle", "stall", "store-drop", "drop", "store-500",
                                   "ack-twice", "unauthorized"])
async def test_fault_then_recovery_delivers_exactly_once(harness: Harness, fault: str) -> None:
    records = make_records(7, 3)  # 21 records: three batches of at most 10
    await harness.spool.write(records, {}, 0.0)
    harness.plane.script.extend([fault, fault, "ok", fault])
    await harness.drain()
    assert_delivered_once(harness.plane, records)
    assert harness.plane.faults_served[fault] >= 2
    stats = await harness.spool.stats()
    assert (stats.unsent, stats.quarantined) == (0, 0)
    if fault in ("store-drop", "store-500", "stall"):
        assert harness.plane.duplicates > 0  # committed but unacknowledged batches were resent, deduplicated


async def test_every_fault_mixed_nothing_lost_nothing_twice(harness: Harness) -> None:
    records = make_records(25, 4)
    await harness.spool.write(records, {}, 0.0)
    harness.plane.script.extend(["store-drop", "fail-500", "ack-twice", "throttle", "stall", "drop", "ok",
                                 "store-500", "unauthorized", "fail-503", "ok", "store-drop"] * 3)
    await harness.drain(max_posts=500)
    assert_delivered_once(harness.plane, records)


async def test_retry_after_is_honoured(harness: Harness) -> None:
    await harness.spool.write(make_records(1), {}, 0.0)
    harness.plane.retry_after = "7"
    harness.plane.script.extend(["throttle", "fail-503"])
    await harness.drain()
    assert [d >= 7 for d in harness.delays[:2]] == [True, True]


async def test_retry_after_is_capped(harness: Harness) -> None:
    await harness.spool.write(make_records(1), {}, 0.0)
    harness.plane.retry_after = "86400"
    harness.plane.script.append("throttle")
    await harness.drain()
    assert harness.delays[0] == harness.reporter.settings.retry_after_cap


async def test_backoff_grows_between_failures(harness: Harness) -> None:
    await harness.spool.write(make_records(1), {}, 0.0)
    harness.reporter.backoff.jitter = 0.0  # deterministic ceilings: 1, 2, 4, 8, ...
    harness.plane.script.extend(["fail-500"] * 5)
    await harness.drain()
    assert harness.delays[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]


async def test_rejected_batch_is_bisected_to_the_bad_record(harness: Harness) -> None:
    records = make_records(10)
    bad = records[6].key
    harness.plane.poison.add(bad)
    await harness.spool.write(records, {}, 0.0)
    await harness.drain()
    assert set(harness.plane.records) == {r.key for r in records} - {bad}
    (q,) = await harness.spool.quarantined()
    assert (q["key"], q["status"], q["reason"]) == (bad, 400, "rejected-400")
    assert harness.plane.requests <= 1 + 2 * 4  # log2(10) rounds of halves


async def test_rejected_batch_without_bisection_is_quarantined_whole(harness: Harness, tmp_path: Path) -> None:
    harness.reporter.settings = harness.reporter.settings.model_copy(update={"bisect_rejected": False})
    records = make_records(4)
    await harness.spool.write(records, {}, 0.0)
    harness.plane.script.append("reject")
    await harness.drain()
    assert {q["key"] for q in await harness.spool.quarantined()} == {r.key for r in records}
    assert not harness.plane.records
    assert await harness.spool.requeue_quarantined() == 4  # an operator can send them again
    await harness.drain()
    assert_delivered_once(harness.plane, records)


async def test_too_large_splits(harness: Harness) -> None:
    records = make_records(8)
    await harness.spool.write(records, {}, 0.0)
    harness.plane.script.extend(["too-large", "too-large"])
    await harness.drain()
    assert_delivered_once(harness.plane, records)
    assert not await harness.spool.quarantined()


async def test_token_file_is_reread_after_rotation(harness: Harness, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old-token\n")
    harness.reporter.settings = harness.reporter.settings.model_copy(update={"token_file": str(token)})
    harness.reporter.tokens = type(harness.reporter.tokens)(harness.reporter.settings)
    harness.plane.token = "new-token"
    await harness.spool.write(make_records(2), {}, 0.0)
    async with harness.reporter._http() as http:
        await harness.reporter.report_once(http)  # 401 with the old token
        assert len(harness.plane.records) == 0
        token.write_text("new-token\n")
        await harness.reporter.report_once(http)
    assert len(harness.plane.records) == 2


async def test_no_endpoint_keeps_records(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path / "usage.sqlite3"))
    await spool.open(region="sfo1", node="node-a")
    await spool.write(make_records(3), {}, 0.0)
    reporter = Reporter(UsageSettings(token_file=None), spool, UsageMetrics.create(CollectorRegistry()),
                        region="sfo1", node="node-a", clock=ManualClock())
    async with reporter._http() as http:
        assert await reporter.report_once(http) is False
    assert (await spool.stats()).unsent == 3
    await spool.close()


@pytest.mark.parametrize(("status", "kind", "error"), [
    (200, "ack", ""), (202, "ack", ""), (204, "ack", ""),
    (500, "retry", "status_5xx"), (502, "retry", "status_5xx"), (503, "retry", "status_5xx"),
    (429, "retry", "status_429"), (408, "retry", "status_retry"), (401, "retry", "status_retry"),
    (403, "retry", "status_retry"), (404, "retry", "status_retry"),
    (400, "reject", "rejected"), (409, "reject", "rejected"), (422, "reject", "rejected"),
    (413, "too_large", "rejected"), (302, "retry", "status_retry"),
])
def test_classify(status: int, kind: str, error: str) -> None:
    outcome = classify(status, None, UsageSettings().retry_statuses)
    assert (outcome.kind, outcome.error) == (kind, error)


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), ("", None), ("120", 120.0), ("0", 0.0), ("soon", None),
    (email.utils.formatdate(1_800_000_030, usegmt=True), 30.0),
    (email.utils.formatdate(1_799_999_000, usegmt=True), 0.0),
])
def test_parse_retry_after(value: Any, seconds: float | None) -> None:
    assert parse_retry_after(value, 1_800_000_000.0) == seconds
