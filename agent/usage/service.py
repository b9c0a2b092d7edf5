"""The usage service: pod events → session book → spool → reporter, as one supervised unit.

Wiring only; the rules live in :mod:`agent.usage.sessions`, durability in
:mod:`agent.usage.spool`, delivery in :mod:`agent.usage.reporter`.

Ordering is the whole point. One coroutine owns the :class:`SessionBook`: pod events (from the
informer's handler), checkpoint ticks and the start-up reconcile all go through one queue and
are applied in order; what they decide is written to the spool as one transaction per drained
queue (group commit: the queue is drained ``commit_delay`` after its first item, so under churn
many events share one fsync). The reporter only reads
committed records, so nothing is reported before it is durable. If a spool write fails, the same
write is retried until it succeeds while events wait in the queue: the in-memory book and the
spool never diverge, and nothing is dropped.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from agent.base.clock import Backoff, Clock, SystemClock
from agent.base.tasks import cancel_and_wait, create_guarded_task
from agent.usage.metrics import UsageMetrics
from agent.usage.pods import MeteredPod
from agent.usage.records import make_record
from agent.usage.reporter import Reporter, Sleep
from agent.usage.sessions import Change, Ledger, SessionBook
from agent.usage.settings import UsageSettings
from agent.usage.spool import Spool, SpoolStats

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
    """The pod informer as the usage service uses it (structural: ``agent.kube`` is not imported).

    Its ``convert`` must be :func:`agent.usage.pods.pod_converter` and its selectors
    :func:`agent.usage.pods.pod_selectors`. ``add_handler`` callbacks are called in event
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
        self.spool = Spool(settings.spool_path)
        self.book = SessionBook()
        self.reporter = Reporter(settings, self.spool, self.metrics, region=region, node=node,
                                 clock=self.clock, sleep=sleep)
        self.reconciled = asyncio.Event()  # the book matches the first full LIST; checkpoints run
        # (item, arrival time): an item is applied at the second it arrived, not when the queue drains,
        # so group commit and a busy loop never move a checkpoint past an event that came after it.
        self._queue: asyncio.Queue[tuple[Any, int]] = asyncio.Queue()
        self._over_bound = False
        self._last_bound_log: float | None = None
        self._busy = False
        self._unwritten: Change | None = None  # decided but not yet committed (a failed or cancelled write)
        self._pending: list[tuple[Any, int]] = []  # taken from the queue, waiting for the group commit
        pods.add_handler(self._on_event)

    def _on_event(self, event: Any) -> None:
        self._enqueue(event)

    def _enqueue(self, item: Any) -> None:
        self._queue.put_nowait((item, int(self.clock.wall())))

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being applied (tests)."""
        return self._queue.empty() and not self._pending and not self._busy

    async def run(self) -> None:
        stats = await self.spool.open(region=self.region, node=self.node)
        self.book.restore(Ledger.from_wire(row) for row in await self.spool.load_ledgers())
        self.metrics.observe_spool(stats, self.clock.wall())
        self.metrics.open_sessions.set(self.book.open_sessions)
        logger.info("usage spool %s open: %d pods with ledgers, %d records unsent, %d quarantined",
                    self.settings.spool_path, len(self.book.ledgers), stats.unsent, stats.quarantined)
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
            self._pending.append(await self._queue.get())
            if self.settings.commit_delay > 0:
                # Group commit: real time, not the injected clock; this is about I/O batching. Items
                # wait in _pending, where a shutdown during this sleep still finds them.
                await asyncio.sleep(self.settings.commit_delay)
            self._pending.extend(self._drain())
            # No await between taking the items and applying them to the book (the first await in
            # _apply is the spool write, whose change _unwritten keeps): a cancel loses nothing.
            items, self._pending = self._pending, []
            self._busy = True
            try:
                await self._apply(items)
            finally:
                self._busy = False

    def _drain(self) -> list[tuple[Any, int]]:
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

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
        if change or self._unwritten is not None:
            await self._persist(change)
        self.metrics.open_sessions.set(self.book.open_sessions)
        self.metrics.last_success.labels("events").set(self.clock.wall())
        if ticked:
            await self.spool.prune_sent(self.clock.wall() - self.settings.sent_retention)
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

    async def _persist(self, change: Change) -> None:
        if self._unwritten is not None:  # an earlier write never committed: it goes first, in order
            earlier, self._unwritten = self._unwritten, None
            earlier.extend(change)
            change = earlier
        self._unwritten = change
        records = [make_record(piece, region=self.region, node=self.node) for piece in change.slices]
        ledgers = {uid: None if led is None else json.dumps(led.to_wire(), separators=(",", ":"))
                   for uid, led in change.ledgers.items()}
        backoff = Backoff(initial=0.5, cap=30.0)
        while True:
            try:
                result = await self.spool.write(records, ledgers, self.clock.wall())
                self._unwritten = None
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                # The book already moved; the spool must catch up before anything else happens.
                self.metrics.loop_errors.labels("spool").inc()
                delay = backoff.next_delay(self.clock.monotonic())
                logger.exception("usage spool write of %d records failed; retrying in %.1f s (events wait)",
                                 len(records), delay)
                await self.sleep(delay)
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
        if not self.spool.is_open:
            return
        pending, self._pending = self._pending, []
        items = [entry for entry in pending + self._drain() if not isinstance(entry[0], _Tick)]
        if self.reconciled.is_set():
            items.append((_TICK, int(self.clock.wall())))
        if items or self._unwritten is not None:
            try:
                await asyncio.wait_for(self._apply(items), timeout=10.0)
            except Exception:
                logger.exception("usage shutdown checkpoint failed; open sessions resume from the last one")
