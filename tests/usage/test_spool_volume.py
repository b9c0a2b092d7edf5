"""A bad spool volume: unwritable at start, corrupt files, read-only with unsent rows, a full journal.

Read-only is made for real: the tests run as root, where ``chmod`` does not stop writes, so they
set the immutable attribute (``chattr +i``), which stops root too; as another user ``chmod`` is
enough. With the ``-wal``/``-shm`` files present, an immutable spool opens and reads but every
write fails with ``SQLITE_READONLY``: exactly a read-only volume that already holds a spool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sqlite3
import stat
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from region_agent.usage.records import Record
from region_agent.usage.spool import Spool, SpoolReadOnlyError, _Db
from tests.usage.harness import Rig, rig, start_service, stop_service

ReadOnly = Callable[..., Callable[[], None]]


@pytest.fixture
def read_only() -> Iterator[ReadOnly]:
    """``undo = read_only(path, ...)``: files and directories unwritable, for root too, until ``undo()``."""
    undos: list[Callable[[], None]] = []

    def make(*paths: Path) -> Callable[[], None]:
        targets = [str(p) for p in paths if p.exists()]
        if os.geteuid() == 0:
            done = subprocess.run(["chattr", "+i", *targets], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                subprocess.run(["chattr", "-i", *targets], capture_output=True, check=False)
                pytest.skip(f"read-only as root needs chattr +i on this filesystem: {done.stderr.strip()}")

            def undo() -> None:
                subprocess.run(["chattr", "-i", *targets], check=True)
        else:
            modes = {t: stat.S_IMODE(os.stat(t).st_mode) for t in targets}
            for t, mode in modes.items():
                os.chmod(t, mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))

            def undo() -> None:
                for t, mode in modes.items():
                    os.chmod(t, mode)

        once = [undo]

        def undo_once() -> None:
            while once:
                once.pop()()

        undos.append(undo_once)
        return undo_once

    yield make
    for undo in undos:  # a failed test leaves nothing immutable behind (tmp_path must be removable)
        undo()


async def let_run() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def advance(r: Rig, seconds: float) -> None:
    """Move simulated time without waiting for the service to be idle (its journal may be full)."""
    r.clock.advance(seconds)
    await let_run()


def spool_files(r: Rig) -> list[Path]:
    path = Path(r.settings.spool_path)
    return [path.parent, *(Path(f"{path}{suffix}") for suffix in ("", "-wal", "-shm"))]


async def test_unwritable_spool_directory_at_start_then_writable_bills_exactly(tmp_path: Path,
                                                                               read_only: ReadOnly) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    writable = read_only(spool_dir)  # the spool file can not be created
    async with rig(tmp_path, ready=False) as r:
        await advance(r, 1)
        status = r.service.status
        assert (status.state, status.code) == ("unavailable", "spool-unavailable"), status
        assert r.metric("region_agent_usage_spool_available") == 0
        # A pod starts and ends while the spool can not be opened: its events wait in the journal.
        r.node.start("a")
        await r.caught_up()
        await r.advance_until(lambda: r.metric("region_agent_usage_spool_open_errors_total",
                                               kind="unavailable") >= 3, step=1.0, message="open retried")
        await advance(r, 30)
        r.node.finish("a")
        await r.caught_up()
        assert r.service.journal_events == 3  # the first LIST, a started, a finished
        assert r.metric("region_agent_usage_journal_events") == 3
        assert r.plane.requests == 0 and not r.service.reconciled.is_set()
        assert not spool_dir.joinpath("usage.sqlite3").exists()
        writable()  # the next attempt opens the spool and applies the journal in order
        await r.advance_until(r.service.available.is_set, step=1.0, message="spool opened after the fix")
        await r.advance_until(r.delivered, message="a billed")
        r.assert_billed_exactly()
        assert r.plane.seconds_by_pod()["uid-a"] >= 30  # started before the 30 s advance
        assert r.service.status.state == "ok" and r.metric("region_agent_usage_spool_available") == 1
        assert r.metric("region_agent_usage_journal_events") == 0


def _damage(path: Path, how: str) -> None:
    if how == "not-a-database":
        path.write_bytes(b"this is not an SQLite file\n" * 200)
        return
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE filler (body TEXT)")
    conn.executemany("INSERT INTO filler VALUES (?)", [("x" * 500,) for _ in range(400)])
    conn.commit()
    conn.close()
    data = bytearray(path.read_bytes())
    if how == "truncated":
        del data[len(data) // 2:]
    else:  # quick_check: the header's freelist count disagrees with the file
        data[36:40] = struct.pack(">I", 5)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["not-a-database", "truncated", "fails-quick-check"])
async def test_corrupt_spool_is_moved_aside_and_a_fresh_one_started(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="region_agent.usage")
    path = tmp_path / "spool" / "usage.sqlite3"
    path.parent.mkdir()
    _damage(path, how)
    damaged = path.read_bytes()
    async with rig(tmp_path) as r:  # opens at once: moved aside, then a fresh spool
        (aside,) = [p for p in path.parent.iterdir() if p.name.startswith("usage.sqlite3.corrupt-")]
        assert aside.read_bytes() == damaged, "moved, never rewritten or deleted"
        assert aside.name == "usage.sqlite3.corrupt-20270115T080000Z"  # the clock's wall time, UTC
        assert r.metric("region_agent_usage_spool_moved_aside_total") == 1
        assert r.metric("region_agent_usage_spool_open_errors_total", kind="corrupt") == 1
        assert any(rec.levelno == logging.CRITICAL and "CORRUPT" in rec.getMessage() for rec in caplog.records)
        status = r.service.status
        assert (status.state, status.code) == ("degraded", "spool-moved-aside") and aside.name in status.reason
        r.node.start("a")
        await r.sync()
        await r.advance(75)
        r.node.finish("a")
        await r.sync()
        await r.advance_until(r.delivered, message="billed from the fresh spool")
        r.assert_billed_exactly()
    fresh = sqlite3.connect(path)
    assert fresh.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    assert fresh.execute("SELECT count(*) FROM records").fetchone()[0] == 2
    fresh.close()


async def test_read_only_spool_with_unsent_rows_sends_nothing(tmp_path: Path, read_only: ReadOnly) -> None:
    async with rig(tmp_path) as r:
        await r.plane.outage()  # records stay unsent
        r.node.start("a")
        await r.sync()
        await r.advance(70)
        r.node.finish("a")
        await r.sync()
        assert r.metric("region_agent_usage_spool_unsent_records") == 2
        await stop_service(r)
        r.tasks.clear()
        path = Path(r.settings.spool_path)
        # A volume that went read-only after a crash: the spool and its -wal/-shm are all there.
        live = sqlite3.connect(path)
        assert live.execute("SELECT count(*) FROM records WHERE sent_at IS NULL").fetchone() == (2,)
        shutil.copytree(path.parent, tmp_path / "snapshot")
        live.close()
        shutil.rmtree(path.parent)
        (tmp_path / "snapshot").rename(path.parent)
        await r.plane.recover()
        writable = read_only(*spool_files(r))
        async with ApiClient(Configuration(host=r.fake.url)) as api:
            again = await start_service(r.fake, r.plane, r.clock, r.settings, api, node=r.node, ready=False)
            try:
                await again.advance_until(
                    lambda: again.metric("region_agent_usage_spool_open_errors_total", kind="read-only") >= 3,
                    step=1.0, message="read-only spool refused, retried")
                await advance(again, 60)
                await advance(again, 60)
                assert again.plane.requests == 0, "nothing is sent that could not be marked sent"
                status = again.service.status
                assert (status.state, status.code) == ("unavailable", "spool-read-only"), status
                assert "readonly" in status.reason
                assert again.metric("region_agent_usage_spool_available") == 0
                writable()  # the unsent rows go out once, and the spool says so
                await again.advance_until(again.delivered, step=1.0, message="delivered after the fix")
                again.assert_billed_exactly()
                assert again.plane.duplicates == 0 and again.service.status.state == "ok"
            finally:
                await stop_service(again)


async def test_rows_that_can_not_be_marked_sent_stop_the_reporter(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The volume turns read-only while the agent runs: one acknowledged batch can't be marked, then silence."""
    volume = {"read_only": False}
    mark_sent, open_db = _Db.mark_sent, _Db.open.__func__  # type: ignore[attr-defined]

    def marking(self: _Db, seqs: list[int], now: float) -> object:
        if volume["read_only"]:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return mark_sent(self, seqs, now)

    def opening(cls: type[_Db], path: str, region: str, node: str) -> _Db:
        if volume["read_only"]:
            raise SpoolReadOnlyError(f"{path}: open: attempt to write a readonly database")
        return open_db(cls, path, region, node)  # type: ignore[no-any-return]

    monkeypatch.setattr(_Db, "mark_sent", marking)
    monkeypatch.setattr(_Db, "open", classmethod(opening))
    async with rig(tmp_path) as r:
        await r.plane.outage()
        for name in ("a", "b", "c"):
            r.node.start(name)
        await r.sync()
        await r.advance(65)
        for name in ("a", "b", "c"):
            r.node.finish(name)
        await r.sync()
        unsent = r.metric("region_agent_usage_spool_unsent_records")
        assert unsent == 6  # a checkpoint slice and a final slice per pod
        volume["read_only"] = True
        await r.plane.recover()
        await r.advance_until(lambda: r.plane.requests == 1 and not r.service.available.is_set(), step=1.0,
                              message="one POST acknowledged, marking failed")
        await r.advance(300, step=10)
        assert r.plane.requests == 1, "no POST after the failed mark"
        assert len(r.plane.records) == 6
        assert r.service.status.state == "unavailable"
        assert r.metric("region_agent_usage_spool_unsent_records") == 6
        volume["read_only"] = False
        await r.advance_until(r.delivered, step=1.0, message="marked after the fix")
        r.assert_billed_exactly()
        assert r.plane.duplicates == 6, "the batch acknowledged but not marked was sent once more"


async def test_journal_is_bounded_and_a_reconcile_follows_an_overflow(
    tmp_path: Path, read_only: ReadOnly, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="region_agent.usage")
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    writable = read_only(spool_dir)
    async with rig(tmp_path, ready=False, journal_size=100) as r:
        for i in range(45):  # 90 events: every short pod starts and ends inside the journal
            r.node.start(f"short-{i}")
        await r.caught_up()
        await advance(r, 20)
        for i in range(45):
            r.node.finish(f"short-{i}")
        await r.caught_up()
        assert r.service.journal_events == 91  # and the first LIST
        await advance(r, 5)
        for i in range(20):  # 9 fit, 11 are dropped; all still run when the spool comes back
            r.node.start(f"long-{i}")
        await r.caught_up()
        r.node.start("ghost")  # starts and is deleted inside the dropped window: the documented loss
        await r.caught_up()
        await advance(r, 10)
        r.node.truth.close(r.node.uid("ghost"), r.now)
        r.node.remove("ghost")
        await r.caught_up()
        assert r.service.journal_events == 100
        assert r.metric("region_agent_usage_journal_events") == 100
        assert r.metric("region_agent_usage_journal_dropped_events_total") == 13
        assert any("DROPPED" in rec.getMessage() for rec in caplog.records)
        writable()
        await r.advance_until(r.service.available.is_set, step=1.0, message="spool opened")
        await r.sync()
        status = r.service.status
        assert (status.state, status.code) == ("degraded", "journal-overflow") and "13 pod events" in status.reason
        await r.advance(30)
        for i in range(20):
            r.node.finish(f"long-{i}")
        await r.sync()
        await r.advance_until(lambda: r.metric("region_agent_usage_spool_unsent_records") == 0
                              and r.plane.in_flight == 0 and len(r.plane.seconds_by_pod()) == 65,
                              message="delivered")
        expected = r.node.truth.seconds_by_pod()
        assert expected.pop(r.node.uid("ghost")) == 10
        assert r.plane.seconds_by_pod() == expected  # short pods from the journal, long ones via the reconcile
        assert not r.plane.overlaps() and not r.plane.conflicts


async def test_spool_reopens_after_close(tmp_path: Path) -> None:
    """The service reopens a lost spool: the same object opens again after close (a new worker thread)."""
    spool = Spool(str(tmp_path / "usage.sqlite3"))
    await spool.open(region="sfo1", node="node-a")
    await spool.write([Record("k", "{}", 1)], {}, 1.0)
    await spool.close()
    stats = await spool.open(region="sfo1", node="node-a")
    assert stats.unsent == 1 and spool.generation == 2
    await spool.close()
