"""The durable spool: SQLite on a node volume, the only place usage lives until acknowledged.

Three tables. ``ledgers`` holds one JSON row per pod that has run on this node (its open session
and billing high-water mark, see :mod:`region_agent.usage.sessions`). ``records`` is the outbox: one
row per slice, with the exact JSON text to send, marked ``sent_at`` only after the control
plane answered 2xx, deleted ``sent_retention`` later. ``quarantine`` holds records the control
plane rejected with a verdict (4xx) or that collided with a different record under the same key;
nothing leaves it except by :meth:`Spool.requeue_quarantined`.

Durability: WAL journal with ``synchronous=FULL``, so a committed transaction survives a
SIGKILL *and* a power cut. That matters for billing: a record is reported only after its
transaction committed, and a commit lost after its record was acknowledged would let the next
slice reuse the acknowledged key with different content. Every :meth:`Spool.write` is one
transaction: the slices a change cut and the ledger rows that say they were cut commit together
or not at all.

Opening checks the file before trusting it: ``PRAGMA quick_check`` must pass (a file that is not a
database, truncated or damaged raises :class:`SpoolCorruptError`, and :meth:`Spool.move_aside` renames it
with a timestamp so a fresh spool can start; nothing is ever deleted), and one small write must
commit (a read-only volume raises :class:`SpoolReadOnlyError`: a spool that can not mark records sent
must not be used to send them). Any other failure to open is a :class:`SpoolError`; the caller
retries. After :meth:`Spool.close` the same object can be opened again.

Threading: SQLite calls block, so the connection lives on **one dedicated worker thread** and
every public method is a coroutine that runs its statement there (``run_in_executor`` with a
single-thread pool). Calls are therefore serialised in submission order, the event loop never
waits on disk, and no SQLite object is ever touched from two threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from region_agent.usage.records import Record

logger = logging.getLogger("region_agent.usage.spool")

T = TypeVar("T")

SCHEMA = 1
_DDL = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ledgers (uid TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    body TEXT NOT NULL,
    seconds INTEGER NOT NULL,
    written_at REAL NOT NULL,
    sent_at REAL
);
CREATE INDEX IF NOT EXISTS records_unsent ON records(seq) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS records_sent ON records(sent_at) WHERE sent_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS quarantine (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    body TEXT NOT NULL,
    seconds INTEGER NOT NULL,
    written_at REAL NOT NULL,
    quarantined_at REAL NOT NULL,
    status INTEGER,
    reason TEXT NOT NULL
);
"""


class SpoolError(RuntimeError):
    """The spool can not be used now (no volume, wrong schema, an I/O error); worth retrying later."""


class SpoolCorruptError(SpoolError):
    """Not a SQLite database, truncated, or failing ``PRAGMA quick_check``: move it aside, start afresh."""


class SpoolReadOnlyError(SpoolError):
    """The spool can be read but not written (read-only volume): records could never be marked sent."""


def _classify(path: str, doing: str, exc: sqlite3.Error) -> SpoolError:
    """The SQLite error as the spool's caller must treat it (by SQLite's primary result code)."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = None if code is None else code & 0xFF
    message = f"{path}: {doing}: {exc} ({getattr(exc, 'sqlite_errorname', 'no code')})"
    if primary in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
        return SpoolCorruptError(message)
    if primary == sqlite3.SQLITE_READONLY:
        return SpoolReadOnlyError(message)
    return SpoolError(message)


@dataclass(frozen=True, slots=True)
class Pending:
    """An unsent record as the reporter sees it."""

    seq: int
    key: str
    body: str
    seconds: int
    written_at: float


@dataclass(frozen=True, slots=True)
class SpoolStats:
    unsent: int
    oldest_unsent_at: float | None  # written_at of the oldest unsent record
    quarantined: int
    bytes: int  # live data: (page_count - freelist_count) * page_size


@dataclass(frozen=True, slots=True)
class WriteResult:
    written: int  # new records
    duplicates: int  # identical records already spooled (a replayed change): nothing to do
    conflicts: int  # a different record under an existing key: quarantined, never dropped
    stats: SpoolStats


class Spool:
    """Async facade; the SQLite connection lives on one worker thread (see module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._executor: ThreadPoolExecutor | None = None
        self._db: _Db | None = None
        self.generation = 0  # +1 on every open: a seq read from one opening means nothing in the next

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        # Shielded: a submitted statement always runs and commits, even if the caller is cancelled
        # before the worker thread picked it up; later calls (close) queue behind it.
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-spool")
        return await asyncio.shield(asyncio.get_running_loop().run_in_executor(self._executor, fn, *args))

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def _require(self) -> _Db:
        if self._db is None:
            raise SpoolError("spool is not open")
        return self._db

    async def open(self, *, region: str, node: str) -> SpoolStats:
        """Open, check and probe the file; raises :class:`SpoolError` (or a subclass) when it can't be used."""
        if self._db is not None:
            raise SpoolError(f"{self.path}: already open")
        db = await self._call(_Db.open, self.path, region, node)
        try:
            stats = await self._call(db.stats)
        except BaseException:
            await self._call(db.close)
            raise
        self._db = db
        self.generation += 1
        return stats

    async def move_aside(self, now: float) -> list[str]:
        """Rename the (closed) spool file and its -wal/-shm with a timestamp suffix; the new names."""
        if self._db is not None:
            raise SpoolError(f"{self.path}: close the spool before moving it aside")
        return await self._call(_move_aside, self.path, now)

    async def close(self) -> None:
        """Close the file and stop the worker thread; :meth:`open` may be called again afterwards."""
        db, self._db = self._db, None
        executor, self._executor = self._executor, None
        if executor is None:
            return
        if db is not None:
            try:
                await asyncio.shield(asyncio.get_running_loop().run_in_executor(executor, db.close))
            except sqlite3.Error as exc:  # a failing disk; the connection is gone either way
                logger.warning("closing spool %s: %s", self.path, exc)
        await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)

    async def load_ledgers(self) -> list[dict[str, Any]]:
        return await self._call(self._require().load_ledgers)

    async def write(
        self, records: list[Record], ledgers: Mapping[str, str | None], now: float
    ) -> WriteResult:
        """Spool new records and put/delete ledger rows (``None``) in one transaction."""
        return await self._call(self._require().write, records, dict(ledgers), now)

    async def next_batch(self, limit: int) -> list[Pending]:
        """The oldest unsent records, in spool order."""
        return await self._call(self._require().next_batch, limit)

    async def mark_sent(self, seqs: list[int], now: float) -> SpoolStats:
        """Call only after the control plane answered 2xx for exactly these records."""
        return await self._call(self._require().mark_sent, seqs, now)

    async def quarantine(self, seqs: list[int], now: float, *, status: int | None, reason: str) -> SpoolStats:
        return await self._call(self._require().quarantine, seqs, now, status, reason)

    async def requeue_quarantined(self) -> int:
        """Move every quarantined record back to the outbox (after the control plane was fixed)."""
        return await self._call(self._require().requeue_quarantined)

    async def prune_sent(self, older_than: float) -> int:
        return await self._call(self._require().prune_sent, older_than)

    async def stats(self) -> SpoolStats:
        return await self._call(self._require().stats)

    async def quarantined(self) -> list[dict[str, Any]]:
        """Quarantined records with their verdicts (inspection and tests)."""
        return await self._call(self._require().quarantined)


class _Db:
    """The synchronous half. Every method runs on the spool's worker thread only."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.unsent = conn.execute("SELECT count(*) FROM records WHERE sent_at IS NULL").fetchone()[0]
        self.quarantined_count = conn.execute("SELECT count(*) FROM quarantine").fetchone()[0]

    @classmethod
    def open(cls, path: str, region: str, node: str) -> _Db:
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"{path}: can not create directory {directory}: {exc}") from exc
        try:
            conn = sqlite3.connect(path, isolation_level=None, timeout=30.0)
        except sqlite3.Error as exc:
            raise _classify(path, "open", exc) from exc
        try:
            cls._prepare(conn, path, region, node)
            return cls(conn)
        except sqlite3.Error as exc:
            conn.close()
            raise _classify(path, "open", exc) from exc
        except BaseException:
            conn.close()
            raise

    @staticmethod
    def _prepare(conn: sqlite3.Connection, path: str, region: str, node: str) -> None:
        # quick_check reads every page once (not the index contents, which integrity_check also
        # compares): it finds truncation and damaged pages at a fraction of the cost.
        problems = [str(row[0]) for row in conn.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise SpoolCorruptError(f"{path}: PRAGMA quick_check: {'; '.join(problems[:3])[:300]}")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise SpoolError(f"{path}: SQLite refused WAL mode (got {mode}); is the volume a network filesystem?")
        conn.execute("PRAGMA synchronous=FULL")
        conn.executescript(_DDL)
        found = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        if found and found.get("schema") != str(SCHEMA):
            raise SpoolError(f"{path}: spool schema {found.get('schema')}, this agent reads {SCHEMA}")
        if found and (found.get("region"), found.get("node")) != (region, node):
            # Records keep their own region and node; only future ones are this node's.
            logger.warning("spool %s was written for %s/%s, now used by %s/%s", path,
                           found.get("region"), found.get("node"), region, node)
        # The probe: one committed write. On a read-only volume an existing spool still opens and
        # reads, but marking records sent would fail after every POST; better to know now.
        with _Transaction(conn):
            if not found:
                conn.executemany("INSERT INTO meta(name, value) VALUES (?, ?)",
                                 [("schema", str(SCHEMA)), ("region", region), ("node", node)])
            conn.execute("INSERT INTO meta(name, value) VALUES ('opened_at', ?) "
                         "ON CONFLICT(name) DO UPDATE SET value = excluded.value", (repr(time.time()),))

    def close(self) -> None:
        self.conn.close()

    def load_ledgers(self) -> list[dict[str, Any]]:
        return [json.loads(body) for (body,) in self.conn.execute("SELECT body FROM ledgers")]

    def write(self, records: list[Record], ledgers: dict[str, str | None], now: float) -> WriteResult:
        written = duplicates = conflicts = 0
        with _Transaction(self.conn):
            for rec in records:
                cur = self.conn.execute(
                    "INSERT INTO records(key, body, seconds, written_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(key) DO NOTHING", (rec.key, rec.body, rec.seconds, now))
                if cur.rowcount == 1:
                    written += 1
                    continue
                (existing,) = self.conn.execute(
                    "SELECT body FROM records WHERE key = ?", (rec.key,)).fetchone()
                if existing == rec.body:
                    duplicates += 1
                    continue
                conflicts += 1
                logger.error("usage record key %s already spooled with different content; the new record "
                             "is quarantined (reason key-conflict), nothing is dropped", rec.key)
                self.conn.execute(
                    "INSERT INTO quarantine(key, body, seconds, written_at, quarantined_at, status, reason) "
                    "VALUES (?, ?, ?, ?, ?, NULL, 'key-conflict')",
                    (rec.key, rec.body, rec.seconds, now, now))
            puts = [(uid, body) for uid, body in ledgers.items() if body is not None]
            deletes = [(uid,) for uid, body in ledgers.items() if body is None]
            if puts:
                self.conn.executemany(
                    "INSERT INTO ledgers(uid, body) VALUES (?, ?) "
                    "ON CONFLICT(uid) DO UPDATE SET body = excluded.body", puts)
            if deletes:
                self.conn.executemany("DELETE FROM ledgers WHERE uid = ?", deletes)
        self.unsent += written
        self.quarantined_count += conflicts
        return WriteResult(written, duplicates, conflicts, self.stats())

    def next_batch(self, limit: int) -> list[Pending]:
        rows = self.conn.execute(
            "SELECT seq, key, body, seconds, written_at FROM records "
            "WHERE sent_at IS NULL ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return [Pending(*row) for row in rows]

    def mark_sent(self, seqs: list[int], now: float) -> SpoolStats:
        changed = 0
        with _Transaction(self.conn):
            for chunk in _chunks(seqs, 500):
                marks = ",".join("?" * len(chunk))
                changed += self.conn.execute(
                    f"UPDATE records SET sent_at = ? WHERE sent_at IS NULL AND seq IN ({marks})",
                    (now, *chunk)).rowcount
        self.unsent -= changed
        return self.stats()

    def quarantine(self, seqs: list[int], now: float, status: int | None, reason: str) -> SpoolStats:
        moved = 0
        with _Transaction(self.conn):
            for chunk in _chunks(seqs, 500):
                marks = ",".join("?" * len(chunk))
                moved += self.conn.execute(
                    "INSERT INTO quarantine(key, body, seconds, written_at, quarantined_at, status, reason) "
                    f"SELECT key, body, seconds, written_at, ?, ?, ? FROM records WHERE sent_at IS NULL "
                    f"AND seq IN ({marks})", (now, status, reason, *chunk)).rowcount
                self.conn.execute(f"DELETE FROM records WHERE sent_at IS NULL AND seq IN ({marks})", chunk)
        self.unsent -= moved
        self.quarantined_count += moved
        return self.stats()

    def requeue_quarantined(self) -> int:
        moved = 0
        with _Transaction(self.conn):
            rows = self.conn.execute(
                "SELECT id, key, body, seconds, written_at FROM quarantine ORDER BY id").fetchall()
            for row_id, key, body, seconds, written_at in rows:
                cur = self.conn.execute(
                    "INSERT INTO records(key, body, seconds, written_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(key) DO NOTHING", (key, body, seconds, written_at))
                if cur.rowcount == 1:  # a key-conflict record stays until a human decides
                    self.conn.execute("DELETE FROM quarantine WHERE id = ?", (row_id,))
                    moved += 1
        self.unsent += moved
        self.quarantined_count -= moved
        return moved

    def prune_sent(self, older_than: float) -> int:
        with _Transaction(self.conn):
            pruned = self.conn.execute(
                "DELETE FROM records WHERE sent_at IS NOT NULL AND sent_at < ?", (older_than,)).rowcount
        return int(pruned)

    def quarantined(self) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT key, body, seconds, status, reason, quarantined_at FROM quarantine ORDER BY id"
        ).fetchall()
        return [{"key": k, "body": b, "seconds": s, "status": st, "reason": r, "quarantined_at": q}
                for k, b, s, st, r, q in rows]

    def stats(self) -> SpoolStats:
        oldest = self.conn.execute(
            "SELECT written_at FROM records WHERE sent_at IS NULL ORDER BY seq LIMIT 1").fetchone()
        page_size = self.conn.execute("PRAGMA page_size").fetchone()[0]
        pages = self.conn.execute("PRAGMA page_count").fetchone()[0]
        free = self.conn.execute("PRAGMA freelist_count").fetchone()[0]
        return SpoolStats(self.unsent, None if oldest is None else float(oldest[0]), self.quarantined_count,
                          (pages - free) * page_size)


class _Transaction:
    """BEGIN IMMEDIATE … COMMIT, ROLLBACK on any error (the connection runs in autocommit mode)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
            return
        with contextlib.suppress(sqlite3.Error):  # keep the original error, not the rollback's
            self.conn.execute("ROLLBACK")


def _move_aside(path: str, now: float) -> list[str]:
    """``usage.sqlite3`` → ``usage.sqlite3.corrupt-20261130T223000Z`` (with -wal/-shm); never deletes."""
    base = f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))}"
    target = base
    for n in range(1, 1000):  # two in one second: number them
        if not any(os.path.lexists(target + suffix) for suffix in ("", "-wal", "-shm")):
            break
        target = f"{base}.{n}"
    else:
        raise SpoolError(f"{path}: can not find a free name to move the corrupt spool aside ({base}.*)")
    moved = []
    for suffix in ("", "-wal", "-shm"):  # the WAL may hold committed transactions: it stays with its file
        if os.path.lexists(path + suffix):
            os.replace(path + suffix, target + suffix)
            moved.append(target + suffix)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)  # the renames survive a power cut
    finally:
        os.close(directory)
    return moved


def _chunks(items: list[int], size: int) -> Iterable[list[int]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
