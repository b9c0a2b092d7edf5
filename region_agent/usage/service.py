"""The usage service: pod events → session book → spool → reporter, as one supervised unit.

Wiring only; the rules live in :mod:`region_agent.usage.sessions`, durability in
:mod:`region_agent.usage.spool`, delivery in :mod:`region_agent.usage.reporter`.

Ordering is the whole point. One coroutine owns the :class:`SessionBook`: pod events (from the
informer's handler), checkpoint ticks and the start-up reconcile all go through one queue and
are applied in order; what they decide is written to the spool as one transaction per drained
queue (group commit: the queue is drained ``commit_delay`` after its first item, so under churn
many events share one fsync). The reporter only reads
committed records, so nothing is reported before it is durable. If a spool write fails, the same
write is retried until it succeeds while events wait in the queue: the in-memory book and the
spool never diverge, and nothing is dropped.

A bad volume does not stop metering. Opening the spool is retried with backoff and jitter; until
it opens (and whenever a write, a prune or marking records sent fails later) the spool is
*unavailable*: pod events wait in the queue, which is then a journal bounded by ``journal_size``,
nothing is reported, and :attr:`UsageService.status` says why. Once the spool opens the journal is
applied in order, so a pod that started and ended meanwhile is billed exactly. Events beyond the
bound are dropped, counted and logged, and a reconcile with the pod list follows the journal: a
pod still listed loses nothing, one that started and was deleted in the dropped window is lost.
A corrupt file is renamed aside (never deleted) and a fresh spool started; the in-memory book is
then written into it whole.

Start-up: the spool's ledgers are restored first; checkpoints wait until the pod watch has
completed its first full LIST and the book was reconciled with it, so a session of a pod that
died while the agent was down is never extended past its last known time. Shutdown (cancel):
queued events are applied and every open session is checkpointed, so a graceful restart loses
nothing at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry

from region_agent.base.clock import Backoff, Clock, SystemClock
from region_agent.base.tasks import cancel_and_wait, create_guarded_task
from region_agent.usage.metrics import UsageMetrics
from region_agent.usage.pods import MeteredPod
from region_agent.usage.records import make_record
from region_agent.usage.reporter import Reporter, Sleep
from region_agent.usage.sessions import Change, Ledger, SessionBook
from region_agent.usage.settings import UsageSettings
from region_agent.usage.spool import Spool, SpoolCorruptError, SpoolReadOnlyError, SpoolStats

logger = logging.getLogger("region_agent.usage.service")


class PodEvent(Protocol):
    """One change of the pod cache (the informer's ``WatchEvent`` satisfies it)."""

    @property
    def type(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def obj(self) -> MeteredPod: ...

    @property
    def old(self) -> MeteredPod | None: ...

    @property
    def final_state_unknown(self) -> bool: ...


class PodSource(Protocol):
    """The pod informer as the usage service uses it (structural: ``region_agent.kube`` is not imported).

    Its ``convert`` must be :func:`region_agent.usage.pods.pod_converter` and its selectors
    :func:`region_agent.usage.pods.pod_selectors`. ``add_handler`` callbacks are called in event
    order from the informer's task and must not block; this service's handler only enqueues.
    """

    @property
    def items(self) -> Mapping[str, MeteredPod]: ...

    @property
    def synced(self) -> asyncio.Event: ...

    def add_handler(self, handler: Callable[[Any], Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class _Tick:
    pass


@dataclass(frozen=True, slots=True)
class _Reconcile:
    pods: tuple[MeteredPod, ...]


_TICK = _Tick()

State = Literal["ok", "degraded", "unavailable"]


@dataclass(frozen=True, slots=True)
class UsageStatus:
    """What the supervisor shows of usage metering (``/health/region``, ``/readyz``).

    ``unavailable``: the spool can not be opened or written; nothing is reported and pod events
    wait in the bounded journal. ``degraded``: metering works but something needs an operator
    (a corrupt spool was moved aside, or journaled events were dropped); it stays until restart.
    ``code`` is a short token for public answers, ``reason`` the sentence for operators.
    """

    state: State
    code: str
    reason: str


class UsageService:
    """Meter the project pods on this node. Construct before the informer runs; ``await run()``."""

    def __init__(
        self, settings: UsageSettings, *, region: str, node: str, pods: PodSource,
        registry: CollectorRegistry, clock: Clock | None = None, sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.settings = settings
        self.region = region
        self.node = node
        self.pods = pods
        self.clock: Clock = clock or SystemClock()
        self.sleep = sleep
        self.metrics = UsageMetrics.create(registry)
        self.metrics.spool_max_bytes.set(settings.max_spool_bytes)
        self.metrics.spool_available.set(0)
        self.spool = Spool(settings.spool_path)
        self.available = asyncio.Event()  # the spool is open and was written: events apply, records go out
        self.book = SessionBook()
        self.reporter = Reporter(settings, self.spool, self.metrics, region=region, node=node,
                                 clock=self.clock, sleep=sleep, available=self.available,
                                 spool_lost=self._spool_lost)
        self.reconciled = asyncio.Event()  # the book matches the first full LIST; checkpoints run
        # (item, arrival time): an item is applied at the second it arrived, not when the queue drains,
        # so group commit and a busy loop never move a checkpoint past an event that came after it.
        # While the spool is unavailable this queue is the journal (bounded by journal_size).
        self._queue: deque[tuple[Any, int]] = deque()
        self._arrived = asyncio.Event()
        self._over_bound = False
        self._last_bound_log: float | None = None
        self._busy = False
        self._unwritten: Change | None = None  # decided but not yet committed (a failed or cancelled write)
        self._restored = False  # the book holds the spool's ledgers; from then on the book leads
        self._spool_failures = 0  # failed opens/writes since the spool was last available
        self._spool_backoff = Backoff(initial=settings.spool_retry_initial, cap=settings.spool_retry_cap,
                                      reset_after=max(120.0, 4 * settings.spool_retry_cap))
        self._unavailable = ("spool-not-open", f"spool {settings.spool_path} has not been opened yet")
        self._degraded: dict[str, tuple[str, str]] = {}  # topic → (code, reason); sticky until restart
        self._dropped = 0  # pod events dropped since the spool was last available
        self._dropped_total = 0
        pods.add_handler(self._on_event)

    # --- state --------------------------------------------------------------------------

    def problems(self) -> tuple[str, ...]:
        status = self.status
        return () if status.state == "ok" else (f"usage {status.state} ({status.code}): {status.reason}",)

    @property
    def status(self) -> UsageStatus:
        if not self.available.is_set():
            code, reason = self._unavailable
            return UsageStatus("unavailable", code, f"{reason}; nothing is reported, {len(self._queue)} "
                               f"events wait in memory (bound {self.settings.journal_size})")
        if self._degraded:
            codes, reasons = zip(*self._degraded.values(), strict=True)
            return UsageStatus("degraded", ",".join(codes), "; ".join(reasons))
        return UsageStatus("ok", "ok", "")

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being applied (tests)."""
        return not self._queue and not self._busy

    @property
    def journal_events(self) -> int:
        return len(self._queue)

    # --- intake -------------------------------------------------------------------------

    def _on_event(self, event: Any) -> None:
        self._enqueue(event)

    def _enqueue(self, item: Any) -> None:
        if not self.available.is_set() and not isinstance(item, _Reconcile):
            if isinstance(item, _Tick):
                return  # no spool to checkpoint into; billing resumes from billed_to when it is back
            if len(self._queue) >= self.settings.journal_size:
                self._drop(item)
                return
        self._queue.append((item, int(self.clock.wall())))
        self._arrived.set()
        self.metrics.journal_events.set(len(self._queue))

    def _drop(self, event: Any) -> None:
        self._dropped += 1
        self._dropped_total += 1
        self.metrics.journal_dropped.inc()
        if self._dropped == 1 or self._dropped % 1000 == 0:
            logger.error("usage journal full (%d events) while spool %s is unavailable: pod events are DROPPED "
                         "(%d so far, latest %s %s); once the spool is back the agent reconciles with the pod "
                         "list, and pods that started and were deleted meanwhile are NOT billed",
                         self.settings.journal_size, self.settings.spool_path, self._dropped,
                         getattr(event, "type", "?"), getattr(event, "key", "?"))

    # --- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        tasks = [
            create_guarded_task(self.reporter.run(), name="usage-reporter", log=logger),
            create_guarded_task(self._ticker(), name="usage-checkpoints", log=logger),
            # Not guarded: it ends by design once the pod watch has synced.
            asyncio.get_running_loop().create_task(self._reconcile_when_synced(), name="usage-reconcile"),
        ]
        try:
            await self._process()
        finally:
            await cancel_and_wait(tasks)
            try:
                await self._shutdown_checkpoint()
            finally:
                self._mark_unavailable("spool-not-open", "usage metering stopped")
                await self.spool.close()

    async def _ticker(self) -> None:
        while True:
            await self.sleep(self.settings.checkpoint_interval)
            self._enqueue(_TICK)

    async def _reconcile_when_synced(self) -> None:
        await self.pods.synced.wait()
        # Snapshot now: events already queued describe states up to this snapshot, later ones after it.
        self._enqueue(_Reconcile(tuple(self.pods.items.values())))

    async def _process(self) -> None:
        while True:
            if not self.available.is_set():
                await self._open_spool()
                continue
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            if self.settings.commit_delay > 0:
                # Group commit: real time, not the injected clock; this is about I/O batching. Items
                # stay in the queue meanwhile, where a shutdown during this sleep still finds them.
                await asyncio.sleep(self.settings.commit_delay)
                if not self.available.is_set():
                    continue
            # No await between taking the items and applying them to the book (the first await in
            # _apply is the spool write, whose change _unwritten keeps): a cancel loses nothing.
            items = list(self._queue)
            self._queue.clear()
            self._busy = True
            try:
                await self._apply(items)
            finally:
                self._busy = False
                self.metrics.journal_events.set(len(self._queue))

    # --- the spool's availability -------------------------------------------------------

    async def _open_spool(self) -> None:
        """Open the spool, retrying with backoff; pod events wait in the journal meanwhile."""
        just_moved = False
        while True:
            if self._spool_failures and not just_moved:
                await self.sleep(self._spool_backoff.next_delay(self.clock.monotonic()))
            await self.spool.close()  # a lost spool's connection and thread go first (no-op when closed)
            try:
                stats = await self.spool.open(region=self.region, node=self.node)
                ledgers = None if self._restored else await self.spool.load_ledgers()
            except asyncio.CancelledError:
                raise
            except SpoolCorruptError as exc:
                if just_moved:  # the fresh file is corrupt too: something below SQLite is broken; back off
                    just_moved = False
                    self._open_failed(exc)
                else:
                    just_moved = await self._move_aside(exc)  # then a fresh spool at once
                continue
            except Exception as exc:
                just_moved = False
                self._open_failed(exc)
                continue
            just_moved = False
            if ledgers is not None:
                self.book.restore(Ledger.from_wire(row) for row in ledgers)
                self._restored = True
                resync = Change()
                logger.info("usage spool %s open: %d pods with ledgers, %d records unsent, %d quarantined",
                            self.settings.spool_path, len(self.book.ledgers), stats.unsent, stats.quarantined)
            else:
                # The book ran ahead of the spool (a write failed, or this is a fresh spool after a
                # corrupt one): the first write carries every ledger, so the spool holds the book again.
                resync = Change(ledgers=dict(self.book.ledgers))
            if (resync or self._unwritten is not None) and not await self._persist(resync):
                continue
            break
        self._became_available(stats)

    def _open_failed(self, exc: BaseException) -> None:
        kind = "read-only" if isinstance(exc, SpoolReadOnlyError) else "unavailable"
        self.metrics.spool_open_errors.labels(kind).inc()
        self._spool_failures += 1
        code = "spool-read-only" if kind == "read-only" else "spool-unavailable"
        reason = f"spool can not be opened: {exc}"
        changed = self._unavailable != (code, reason)
        self._mark_unavailable(code, reason)
        if changed or self._spool_failures % 10 == 0:
            logger.error("usage %s (attempt %d, retrying with backoff); nothing is reported and pod events wait "
                         "in memory: %d of %d", reason, self._spool_failures, len(self._queue),
                         self.settings.journal_size)

    async def _move_aside(self, exc: SpoolCorruptError) -> bool:
        """Rename the corrupt file with a timestamp (never delete it); True when a fresh spool can start."""
        self.metrics.spool_open_errors.labels("corrupt").inc()
        try:
            moved = await self.spool.move_aside(self.clock.wall())
        except Exception as move_error:
            self._open_failed(RuntimeError(f"{exc}; moving it aside failed: {move_error}"))
            return False
        self.metrics.spool_moved_aside.inc()
        target = moved[0] if moved else "(nothing to move)"
        logger.critical("USAGE SPOOL CORRUPT: %s. Moved aside to %s (kept, never deleted) and starting a fresh "
                        "spool. Its unsent records are NOT reported: recover them by hand (README: corrupt spool)",
                        exc, target)
        self._degraded["corrupt"] = ("spool-moved-aside", f"a corrupt spool was moved aside to {target} ({exc}); "
                                     "its unsent records were not reported")
        return True

    def _became_available(self, stats: SpoolStats) -> None:
        now = self.clock.wall()
        if self._spool_failures:
            logger.warning("usage spool %s available again after %d failed attempts; applying %d journaled events",
                           self.settings.spool_path, self._spool_failures, len(self._queue))
        self._spool_failures = 0
        self.metrics.observe_spool(stats, now)
        self.metrics.open_sessions.set(self.book.open_sessions)
        if self._dropped:
            self._degraded["journal"] = (
                "journal-overflow", f"{self._dropped_total} pod events dropped while the spool was unavailable "
                "(journal full); pods that started and were deleted then are not billed")
            logger.error("usage spool back after %d pod events were dropped; reconciling with the pod list",
                         self._dropped)
            self._dropped = 0
            if self.pods.synced.is_set():  # else the first reconcile is still to come and covers it
                self._queue.append((_Reconcile(tuple(self.pods.items.values())), int(now)))
        self.available.set()
        self.metrics.spool_available.set(1)
        self._arrived.set()

    def _mark_unavailable(self, code: str, reason: str) -> None:
        self._unavailable = (code, reason)
        self.available.clear()
        self.metrics.spool_available.set(0)

    def _spool_lost(self, reason: str) -> None:
        """A spool call failed (the reporter's or ours): stop reporting, journal events, reopen with backoff."""
        self._spool_failures += 1
        was_available = self.available.is_set()
        self._mark_unavailable("spool-unavailable", reason)
        if was_available:
            logger.error("usage spool unavailable: %s. Sending stops and pod events wait in memory (up to %d) "
                         "until the spool can be opened and written again", reason, self.settings.journal_size)
        self._arrived.set()  # wake the loop: it reopens

    # --- applying events ----------------------------------------------------------------

    async def _apply(self, items: list[tuple[Any, int]]) -> None:
        change = Change()
        ticked = False
        for item, now in items:
            if isinstance(item, _Tick):
                if self.reconciled.is_set():
                    change.extend(self.book.checkpoint(now, cut=not self._over_bound))
                    ticked = True
            elif isinstance(item, _Reconcile):
                change.extend(self.book.reconcile({p.uid: p for p in item.pods}, now))
                if not self.reconciled.is_set():
                    logger.info("usage reconciled with %d pods on node %s", len(item.pods), self.node)
                self.reconciled.set()
            else:
                change.extend(self._event(item, now))
        if (change or self._unwritten is not None) and not await self._persist(change):
            return
        self.metrics.open_sessions.set(self.book.open_sessions)
        self.metrics.last_success.labels("events").set(self.clock.wall())
        if ticked:
            try:
                await self.spool.prune_sent(self.clock.wall() - self.settings.sent_retention)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.loop_errors.labels("spool").inc()
                self._spool_lost(f"pruning sent records failed: {exc}")
                return
            self.metrics.last_success.labels("checkpoint").set(self.clock.wall())

    def _event(self, event: PodEvent, now: int) -> Change:
        pod = event.obj
        if event.type == "DELETED":
            return self.book.vanish(pod.uid, pod, now, final_state_unknown=event.final_state_unknown)
        change = Change()
        if event.old is not None and event.old.uid != pod.uid:
            # Same name, new pod: the old one was deleted while the watch could not see it.
            change.extend(self.book.vanish(event.old.uid, event.old, now, final_state_unknown=True))
        change.extend(self.book.observe(pod, now))
        return change

    async def _persist(self, change: Change) -> bool:
        """Write the change (after any earlier unwritten one); False: the spool is lost, the change kept."""
        if self._unwritten is not None:  # an earlier write never committed: it goes first, in order
            earlier, self._unwritten = self._unwritten, None
            earlier.extend(change)
            change = earlier
        self._unwritten = change
        records = [make_record(piece, region=self.region, node=self.node) for piece in change.slices]
        ledgers = {uid: None if led is None else json.dumps(led.to_wire(), separators=(",", ":"))
                   for uid, led in change.ledgers.items()}
        try:
            result = await self.spool.write(records, ledgers, self.clock.wall())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The book already moved; the spool catches up once it is back (the change stays in _unwritten).
            self.metrics.loop_errors.labels("spool").inc()
            logger.exception("usage spool write of %d records failed; reopening the spool with backoff "
                             "(events wait in memory)", len(records))
            self._spool_lost(f"spool write failed: {exc}")
            return False
        self._unwritten = None
        self._spool_backoff.reset()
        self.metrics.sessions_opened.inc(change.opened)
        for reason in change.closed:
            self.metrics.sessions_recorded.labels(reason.value).inc()
        self.metrics.records_written.inc(result.written)
        self.metrics.seconds_written.inc(sum(r.seconds for r in records))
        if result.conflicts:
            self.metrics.key_conflicts.inc(result.conflicts)
            self.metrics.records_quarantined.labels("key-conflict").inc(result.conflicts)
        self.metrics.observe_spool(result.stats, self.clock.wall())
        self._check_bound(result.stats)
        self.reporter.notify(result.stats.unsent)
        return True

    def _check_bound(self, stats: SpoolStats) -> None:
        limit = self.settings.max_spool_bytes
        over = stats.bytes >= limit
        if over != self._over_bound:
            if over:
                logger.error("usage spool %s reached its bound (%d of %d bytes, %d unsent records): "
                             "checkpoints stop cutting records, open sessions keep accruing and closed ones "
                             "are still written; nothing is dropped. Is the control plane reachable?",
                             self.settings.spool_path, stats.bytes, limit, stats.unsent)
            else:
                logger.warning("usage spool back under its bound (%d of %d bytes)", stats.bytes, limit)
            self._over_bound = over
        elif stats.bytes >= limit * self.settings.spool_warn_fraction and self._bound_log_due():
            oldest = 0.0 if stats.oldest_unsent_at is None else self.clock.wall() - stats.oldest_unsent_at
            logger.error("usage spool %s is at %.0f%% of its bound (%d of %d bytes, %d unsent records, "
                         "oldest %.0f s): the control plane is not taking records", self.settings.spool_path,
                         100.0 * stats.bytes / limit, stats.bytes, limit, stats.unsent, oldest)

    def _bound_log_due(self) -> bool:
        now = self.clock.monotonic()
        last = self._last_bound_log
        if last is not None and now - last < self.settings.checkpoint_interval:
            return False
        self._last_bound_log = now
        return True

    async def _shutdown_checkpoint(self) -> None:
        """Apply what is queued and checkpoint open sessions, so a graceful restart loses nothing."""
        if not self.available.is_set():
            if self._queue or self._unwritten is not None:
                logger.error("usage stops while the spool is unavailable: %d journaled events are lost (the next "
                             "start reconciles with the pod list)", len(self._queue))
            return
        items = [entry for entry in self._queue if not isinstance(entry[0], _Tick)]
        self._queue.clear()
        if self.reconciled.is_set():
            items.append((_TICK, int(self.clock.wall())))
        if items or self._unwritten is not None:
            try:
                await asyncio.wait_for(self._apply(items), timeout=10.0)
            except Exception:
                logger.exception("usage shutdown checkpoint failed; open sessions resume from the last one")
