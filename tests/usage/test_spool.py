"""The SQLite spool: atomic writes, durability across SIGKILL, outbox states, quarantine."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from region_agent.usage.records import Record
from region_agent.usage.spool import Spool, SpoolError, _Db
from tests.conftest import wait_for_sync


def rec(key: str, seconds: int = 60) -> Record:
    return Record(key, f'{{"key":"{key}","seconds":{seconds}}}', seconds)


@pytest.fixture
async def spool(tmp_path: Path) -> Any:
    s = Spool(str(tmp_path / "spool" / "usage.sqlite3"))
    await s.open(region="sfo1", node="node-a")
    yield s
    await s.close()


async def test_pragmas_and_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "usage.sqlite3")
    s = Spool(path)
    await s.open(region="sfo1", node="node-a")
    await s.write([rec("a"), rec("b")], {"uid-1": '{"x":1}', "uid-2": '{"x":2}'}, 100.0)
    await s.write([], {"uid-2": None}, 101.0)
    await s.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    again = Spool(path)
    stats = await again.open(region="sfo1", node="node-a")
    assert stats.unsent == 2 and stats.oldest_unsent_at == 100.0
    assert await again.load_ledgers() == [{"x": 1}]
    assert [p.key for p in await again.next_batch(10)] == ["a", "b"]
    await again.close()


async def test_write_is_all_or_nothing(spool: Spool) -> None:
    bad = Record("c", "{}", object())  # type: ignore[arg-type]  # SQLite can not bind it: the write fails midway
    with pytest.raises(sqlite3.Error):
        await spool.write([rec("a"), rec("b"), bad], {"uid-1": '{"x":1}'}, 100.0)
    assert await spool.next_batch(10) == []
    assert await spool.load_ledgers() == []
    assert (await spool.stats()).unsent == 0


async def test_duplicates_are_idempotent_and_conflicts_quarantined(spool: Spool) -> None:
    first = await spool.write([rec("a", 60)], {}, 100.0)
    assert (first.written, first.duplicates, first.conflicts) == (1, 0, 0)
    replay = await spool.write([rec("a", 60)], {}, 101.0)
    assert (replay.written, replay.duplicates, replay.conflicts) == (0, 1, 0)
    clash = await spool.write([rec("a", 61)], {}, 102.0)
    assert (clash.written, clash.duplicates, clash.conflicts) == (0, 0, 1)
    assert clash.stats.unsent == 1 and clash.stats.quarantined == 1
    (q,) = await spool.quarantined()
    assert q["reason"] == "key-conflict" and q["seconds"] == 61


async def test_outbox_lifecycle(spool: Spool) -> None:
    await spool.write([rec(f"k{i}") for i in range(5)], {}, 100.0)
    batch = await spool.next_batch(3)
    assert [p.key for p in batch] == ["k0", "k1", "k2"]
    stats = await spool.mark_sent([p.seq for p in batch], 110.0)
    assert stats.unsent == 2 and stats.oldest_unsent_at == 100.0
    # Marking again (a duplicate 2xx) changes nothing.
    assert (await spool.mark_sent([p.seq for p in batch], 111.0)).unsent == 2
    rest = await spool.next_batch(10)
    assert [p.key for p in rest] == ["k3", "k4"]
    stats = await spool.quarantine([rest[0].seq], 120.0, status=400, reason="rejected-400")
    assert (stats.unsent, stats.quarantined) == (1, 1)
    assert await spool.prune_sent(older_than=110.5) == 3
    assert await spool.requeue_quarantined() == 1
    assert [p.key for p in await spool.next_batch(10)] == ["k4", "k3"]
    assert (await spool.stats()).quarantined == 0


async def test_size_is_measured(spool: Spool) -> None:
    before = (await spool.stats()).bytes
    big = [Record(f"k{i}", "x" * 2000, 1) for i in range(200)]
    after = (await spool.write(big, {}, 1.0)).stats.bytes
    assert after - before > 200 * 2000


async def test_statements_run_on_the_worker_thread(spool: Spool, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    original = _Db.next_batch

    def spy(self: _Db, limit: int) -> Any:
        seen.append(threading.current_thread().name)
        return original(self, limit)

    monkeypatch.setattr(_Db, "next_batch", spy)
    await spool.next_batch(1)
    assert seen and seen[0].startswith("usage-spool") and seen[0] != threading.main_thread().name


async def test_wrong_schema_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "usage.sqlite3")
    s = Spool(path)
    await s.open(region="sfo1", node="node-a")
    await s.close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE name = 'schema'")
    conn.commit()
    conn.close()
    again = Spool(path)
    with pytest.raises(SpoolError, match="schema 99"):
        await again.open(region="sfo1", node="node-a")
    await again.close()


WRITER = textwrap.dedent("""
    import asyncio, sys
    from region_agent.usage.records import Record
    from region_agent.usage.spool import Spool

    async def main():
        spool = Spool(sys.argv[1])
        await spool.open(region="sfo1", node="node-a")
        i = 0
        while True:
            i += 1
            # Each transaction: 50 records and the ledger that says they were cut.
            recs = [Record(f"k{i}-{j}", "{}", 1) for j in range(50)]
            await spool.write(recs, {"pod": '{"billed_to": %d}' % i}, float(i))
            print(i, flush=True)  # only after COMMIT returned

    asyncio.run(main())
""")


def test_committed_writes_survive_sigkill(tmp_path: Path) -> None:
    path = str(tmp_path / "usage.sqlite3")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout is not None
    acked = 0

    def enough() -> bool:
        nonlocal acked
        line = proc.stdout.readline() if proc.stdout is not None else ""
        acked = int(line) if line.strip() else acked
        return acked >= 40

    wait_for_sync(enough, timeout=30, message="40 committed transactions")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    conn = sqlite3.connect(path)
    (ledger,) = conn.execute("SELECT body FROM ledgers WHERE uid = 'pod'").fetchone()
    billed_to = int(ledger.split(":")[1].rstrip("}"))
    count = conn.execute("SELECT count(*) FROM records").fetchone()[0]
    last = conn.execute("SELECT max(written_at) FROM records").fetchone()[0]
    conn.close()
    assert billed_to >= acked, "every acknowledged commit survived"
    assert count == 50 * billed_to, "records and ledger committed together, never one without the other"
    assert last == float(billed_to)
