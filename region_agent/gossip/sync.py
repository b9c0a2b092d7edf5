"""Anti-entropy: periodic push-pull of the replicated store with one random peer over a stream.

Fresh updates travel as user broadcasts piggybacked on gossip; this is the repair path that makes
every agent converge whatever was lost (a datagram dropped, an agent restarted or partitioned
away, a batch too big to broadcast). One round, all messages one-way streams (so big payloads
never ride a datagram):

=========  ====================  =====================================================================
phase      direction             carries
=========  ====================  =====================================================================
OFFER      initiator → peer      the initiator's whole digest (16 bytes)
DIGESTS    peer → initiator      the peer's digest; when it differs, also its bucket digests (one per
                                 bucket). Equal digests end the round here.
ENTRIES    initiator → peer      the initiator's entries of every differing bucket, with its digests
                                 of those buckets
FINAL      peer → initiator      after merging: the peer's entries of the buckets that still differ
                                 from the initiator's (the initiator lacks or has older entries), and
                                 which buckets went whole (a pull-only initiator replaces those)
=========  ====================  =====================================================================

One round at a time runs between two agents: a periodic round waits for its own one in flight;
an offer from a peer we already run a round with is answered "busy" (DIGESTS with ``more`` and no
buckets: the initiator defers); two offers that cross yield to the higher member name. So a slow
catch-up is never sent twice. An in-sync pair exchanges two small messages, and a differing pair
exchanges only the buckets that differ, each way at most once. A message carries at most
``budget`` bytes of entries (whole buckets); when a side had more, ``more`` is set and the
initiator starts the next round with the same peer at once, so a rejoining agent catches up on
a large store in a few bounded steps.

**Pull-only rejoin.** An agent that has completed no round counted as fresh (one while it saw a
majority of regions, where every delete is made) for longer than ``absent_limit`` may hold entries
whose deletes every peer has since forgotten (tombstones expire). It turns *pull-only*: its offers
say so (``more`` on an OFFER), it sends no entries, and each bucket a peer returns whole replaces its
own (what the peer lacks is dropped, not re-exported); meanwhile it answers a peer's ordinary offer
"busy", so nothing it holds leaves it. It is fresh again after one complete pull (Cassandra's
``gc_grace_seconds`` rule: a node away longer is rebuilt from the others). Two pull-only agents
answer each other (every agent away that long, no one holds better state): the first to pull takes
the other's. The absence clock survives a restart: the owner keeps :meth:`AntiEntropy.last_fresh_wall`
with the store's snapshot and hands it back through :meth:`AntiEntropy.restore_absence` before any
round, so an agent restarted after a month cut off is pull-only from its start (its first offer and
its first answer included), not fresh because it just started.

This module knows nothing of projects: entries are opaque bytes, digests opaque 16-byte strings,
and the store sits behind :class:`Replica` (``region_agent.app.replication``), which validates and merges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from region_agent.gossip.messages import Address, MessageError, Sync, SyncPhase, encode

logger = logging.getLogger("region_agent.gossip")

DEFAULT_BUDGET = 4 * 1024 * 1024   # entry bytes per message: well under the stream bound
MAX_PEER_DIGESTS = 10_000         # digests remembered (one per member heard from)
MAX_CONTINUATIONS = 64             # rounds in a row with one peer while it keeps saying "more"


class Replica(Protocol):
    """The store behind anti-entropy; entries and digests are opaque here."""

    def digest(self) -> bytes:
        """The whole store's digest (16 bytes)."""
        ...

    def bucket_digests(self) -> Sequence[bytes]:
        """One 16-byte digest per bucket; every replica has the same number of buckets."""
        ...

    async def export(self, buckets: Sequence[int], budget: int) -> tuple[list[bytes], int]:
        """The encoded entries of ``buckets``, whole buckets in that order up to ``budget`` bytes (at least
        one); and how many of the buckets are in."""
        ...

    async def merge(self, entries: Sequence[bytes], origin: str) -> int:
        """Validate and apply entries from a peer; returns how many changed the store."""
        ...

    async def replace(self, entries: Sequence[bytes], origin: str, buckets: Sequence[int]) -> int:
        """Pull-only: merge ``entries`` (a peer's export holding ``buckets`` whole), then drop this replica's
        entries of those buckets that the peer does not hold; returns how many were dropped."""
        ...


@dataclass
class SyncStats:
    """Plain counters; ``region_agent.gossip.metrics`` exports them."""

    rounds: Counter[str] = field(default_factory=Counter)   # by result: in_sync, repaired, timeout, busy
    entries_sent: int = 0
    entries_received: int = 0
    entries_applied: int = 0
    entries_dropped: int = 0              # pull-only: entries the peers lacked
    last_repair: float | None = None      # wall time the last round changed this store


@dataclass(slots=True)
class _Round:
    peer: Address
    started: float
    continuation: int
    answered: bool = False   # the peer's DIGESTS arrived: the round is under way
    pulled: tuple[int, ...] = ()   # pull-only: the buckets asked for, in order


@dataclass(frozen=True, slots=True)
class PeerDigest:
    digest: str
    seen_at: float   # wall time


class AntiEntropy:
    def __init__(self, *, name: str, replica: Replica, send: Callable[[Address, bytes], None],
                 peers: Callable[[], Sequence[Address]], interval: float, rng: random.Random | None = None,
                 budget: int = DEFAULT_BUDGET, max_sessions: int = 4, round_timeout: float = 15.0) -> None:
        self.name = name
        self.replica = replica
        self.stats = SyncStats()
        self.interval = interval
        self.budget = budget
        self.round_timeout = round_timeout
        self.peer_digests: dict[str, PeerDigest] = {}   # member name → its digest as last heard
        self.synced = asyncio.Event()     # set after the first round that ended in sync or repaired
        self._send = send
        self._peers = peers
        self._rng = rng or random.Random()
        self._rounds: dict[int, _Round] = {}
        self._next_round = self._rng.randrange(1 << 31)
        self.max_sessions = max_sessions   # steps handled at once; more are dropped (bounded work)
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._fanout_now = 0
        # Pull-only rejoin (module docstring): off until the owner sets a limit.
        self.absent_limit: float | None = None
        self.counts: Callable[[], bool] = lambda: True   # whether a round completed now is fresh
        self.on_pull_only: Callable[[bool], None] = lambda _pulling: None
        self.pull_only = False
        self.last_fresh = time.monotonic()   # -inf: unknown (restore_absence), as good as never
        self._dropped_in_pull = 0

    # --- driving ------------------------------------------------------------------------------

    async def run(self) -> None:
        """A round with a random peer every ``interval`` (jittered), or at once after :meth:`sync_now`."""
        try:
            while True:
                delay = self.interval * self._rng.uniform(0.5, 1.5)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                self._wake.clear()
                self._expire_rounds()
                self._check_absence()
                fanout, self._fanout_now = max(1, self._fanout_now), 0
                busy = {state.peer for state in self._rounds.values()}
                peers = [peer for peer in self._peers() if peer not in busy]
                self._rng.shuffle(peers)
                for peer in peers[:fanout]:
                    self.start_round(peer)
        finally:
            for task in list(self._tasks):
                task.cancel()

    def sync_now(self, fanout: int = 1) -> None:
        """Start rounds with ``fanout`` random peers now (a join, a batch too big to broadcast)."""
        self._fanout_now = max(self._fanout_now, fanout)
        self._wake.set()

    def start_round(self, peer: Address, continuation: int = 0) -> None:
        round_id = self._next_round
        self._next_round = (self._next_round + 1) & 0xFFFF_FFFF
        self._rounds[round_id] = _Round(peer, time.monotonic(), continuation)
        self._send_message(peer, Sync(SyncPhase.OFFER, round_id, self.name, digest=self.replica.digest(),
                                      more=self.pull_only))

    # --- absence ------------------------------------------------------------------------------

    def _fresh(self) -> None:
        """A round completed: it keeps this agent fresh if it sees a majority (where deletes are made)."""
        if not self.pull_only and self.counts():
            self.last_fresh = time.monotonic()

    def last_fresh_wall(self) -> float | None:
        """The last fresh round as wall time, by this host's clock now (what a snapshot keeps); None: unknown."""
        if not math.isfinite(self.last_fresh):
            return None
        return time.time() - (time.monotonic() - self.last_fresh)

    def restore_absence(self, away: float) -> None:
        """At start, before any round: the last fresh round was ``away`` seconds ago (``math.inf``: unknown),
        as the snapshot tells; beyond ``absent_limit`` this agent is pull-only at once."""
        self.last_fresh = time.monotonic() - away if math.isfinite(away) else -math.inf
        if self.absent_limit is not None and away > self.absent_limit:
            self._turn_pull_only(away)

    def _check_absence(self) -> None:
        if self.absent_limit is None:
            return
        if not self._peers():
            # Nobody to pull from: alone with a majority (one region) it is the cluster, and fresh (a restart
            # that found itself pull-only too: there is no one whose deletes it could undo); without one it
            # waits, and pulls when a peer comes back.
            if self.counts():
                if self.pull_only:
                    logger.warning("gossip: alone with a majority (the only region): no one to pull from, "
                                   "fresh again")
                    self._rejoined(0)
                self.last_fresh = time.monotonic()
            return
        away = time.monotonic() - self.last_fresh
        if not self.pull_only and away > self.absent_limit:
            self._turn_pull_only(away)

    def _turn_pull_only(self, away: float) -> None:
        assert self.absent_limit is not None
        self.pull_only = True
        self.stats.rounds["pull_only"] += 1
        logger.warning("gossip: no fresh sync for %s (limit %.0f s): rejoining pull-only, taking the peers' state "
                       "and dropping what they lack; DNS and writes wait",
                       f"{away:.0f} s" if math.isfinite(away) else "an unknown time", self.absent_limit)
        self.on_pull_only(True)
        self._fanout_now = max(self._fanout_now, 1)
        self._wake.set()

    def _rejoined(self, dropped: int) -> None:
        self.pull_only = False
        self.last_fresh = time.monotonic()
        logger.warning("gossip: pull-only rejoin complete: %d entries the peers lack dropped", dropped)
        self.on_pull_only(False)

    def _expire_rounds(self) -> None:
        cutoff = time.monotonic() - self.round_timeout
        for round_id in [r for r, state in self._rounds.items() if state.started < cutoff]:
            del self._rounds[round_id]
            self.stats.rounds["timeout"] += 1

    # --- receiving ----------------------------------------------------------------------------

    def receive(self, message: Sync, source: Address) -> None:
        """Handle one step from a peer (called from the transport; never blocks)."""
        if len(self._tasks) >= self.max_sessions:
            self.stats.rounds["busy"] += 1   # the peer's round times out; it will try another
            return
        task = asyncio.get_running_loop().create_task(self._handle(message, source), name=f"gossip-sync-{source}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.stats.rounds["error"] += 1
            logger.error("gossip sync step failed: %r", task.exception())

    async def _handle(self, message: Sync, source: Address) -> None:
        match message.phase:
            case SyncPhase.OFFER:
                await self._on_offer(message, source)
            case SyncPhase.DIGESTS:
                await self._on_digests(message, source)
            case SyncPhase.ENTRIES:
                await self._on_entries(message, source)
            case SyncPhase.FINAL:
                await self._on_final(message)

    async def _on_offer(self, message: Sync, source: Address) -> None:
        self._heard(message.origin, message.digest)
        mine = self.replica.digest()
        if message.more and not self.synced.is_set() and message.digest != mine:
            # A pull takes what this agent holds as the truth: one that never completed a round (started
            # empty, its snapshot moved aside) must not hand a rejoining agent an empty store.
            self._send_message(source, Sync(SyncPhase.DIGESTS, message.round, self.name, digest=mine, more=True))
            return
        if self.pull_only and not message.more and message.digest != mine:
            # What this agent holds may predate deletes the others forgot: none of it leaves (busy).
            self._send_message(source, Sync(SyncPhase.DIGESTS, message.round, self.name, digest=mine, more=True))
            return
        own = next(((r, state) for r, state in self._rounds.items() if state.peer == source), None)
        if own is not None:
            round_id, state = own
            if not state.answered and self.name < message.origin:
                del self._rounds[round_id]   # two offers crossed: the lower name yields, the peer's round runs
                self.stats.rounds["yielded"] += 1
            elif message.digest != mine:
                # Our round with this peer already moves the same buckets: "busy", so they are not sent twice.
                self._send_message(source, Sync(SyncPhase.DIGESTS, message.round, self.name, digest=mine, more=True))
                return
        buckets = () if message.digest == mine else tuple(enumerate(self.replica.bucket_digests()))
        self._send_message(source, Sync(SyncPhase.DIGESTS, message.round, self.name, digest=mine, buckets=buckets))

    async def _on_digests(self, message: Sync, source: Address) -> None:
        state = self._rounds.get(message.round)
        if state is None:
            self.stats.rounds["unknown"] += 1
            return
        self._heard(message.origin, message.digest)
        if message.digest == self.replica.digest():
            del self._rounds[message.round]
            self.stats.rounds["in_sync"] += 1
            if self.pull_only:
                self._rejoined(0)
            self._fresh()
            self.synced.set()
            return
        if message.more and not message.buckets:
            del self._rounds[message.round]   # the peer's own round with us is under way
            self.stats.rounds["deferred"] += 1
            if not self.synced.is_set() or self.pull_only:
                # A restarted agent's catch-up answered "busy" (the peer still holds a round from before
                # the crash): try again soon, not a whole interval later.
                asyncio.get_running_loop().call_later(self._rng.uniform(0.2, 0.6), self.sync_now)
            return
        state.answered = True
        mine = self.replica.bucket_digests()
        differ = [b for b, d in message.buckets if b < len(mine) and mine[b] != d]
        if self.pull_only:
            state.pulled = tuple(differ)   # ask for them all, send nothing
            self._send_message(source, Sync(SyncPhase.ENTRIES, message.round, self.name,
                                            buckets=tuple((b, mine[b]) for b in differ)))
            return
        entries, covered = await self.replica.export(differ, self.budget)
        complete = covered == len(differ)
        self.stats.entries_sent += len(entries)
        self._send_message(source, Sync(SyncPhase.ENTRIES, message.round, self.name,
                                        buckets=tuple((b, mine[b]) for b in differ), entries=tuple(entries),
                                        more=not complete))

    async def _on_entries(self, message: Sync, source: Address) -> None:
        await self._merge(message)
        mine = self.replica.bucket_digests()
        still = [b for b, d in message.buckets if b < len(mine) and mine[b] != d]
        entries, covered = await self.replica.export(still, self.budget) if still else ([], 0)
        self.stats.entries_sent += len(entries)
        # The buckets sent whole: what a pull-only initiator replaces its own with (an empty one included).
        self._send_message(source, Sync(SyncPhase.FINAL, message.round, self.name, digest=self.replica.digest(),
                                        buckets=tuple((b, mine[b]) for b in still[:covered]), entries=tuple(entries),
                                        more=message.more or covered < len(still)))
        self._fresh()

    async def _on_final(self, message: Sync) -> None:
        state = self._rounds.pop(message.round, None)
        if state is None:
            self.stats.rounds["unknown"] += 1
            return
        if self.pull_only and state.answered:
            self.stats.entries_received += len(message.entries)
            asked = set(state.pulled)
            dropped = await self.replica.replace(message.entries, message.origin,
                                                 [b for b, _ in message.buckets if b in asked])
            self._heard(message.origin, message.digest)
            self.stats.rounds["pulled"] += 1
            self.stats.entries_dropped += dropped
            self._dropped_in_pull += dropped
            if not message.more:
                self._rejoined(self._dropped_in_pull)
                self._dropped_in_pull = 0
                self.synced.set()
            elif state.continuation < MAX_CONTINUATIONS:
                self.start_round(state.peer, state.continuation + 1)
            return
        applied = await self._merge(message)
        self._heard(message.origin, message.digest)
        self.stats.rounds["repaired" if applied else "exchanged"] += 1
        self._fresh()
        self.synced.set()
        if message.more and state.continuation < MAX_CONTINUATIONS:
            self.start_round(state.peer, state.continuation + 1)

    async def _merge(self, message: Sync) -> int:
        self.stats.entries_received += len(message.entries)
        if not message.entries:
            return 0
        applied = await self.replica.merge(message.entries, message.origin)
        self.stats.entries_applied += applied
        if applied:
            self.stats.last_repair = time.time()
        return applied

    def _heard(self, origin: str, digest: bytes) -> None:
        if digest:
            self.peer_digests.pop(origin, None)   # re-inserted last: the dict stays in order of hearing
            if len(self.peer_digests) >= MAX_PEER_DIGESTS:
                del self.peer_digests[next(iter(self.peer_digests))]   # bounded: the longest unheard goes
            self.peer_digests[origin] = PeerDigest(digest.hex(), time.time())

    def forget_peer(self, name: str) -> None:
        self.peer_digests.pop(name, None)

    def _send_message(self, peer: Address, message: Sync) -> None:
        try:
            self._send(peer, encode(message))
        except (MessageError, ValueError) as exc:   # too large for the stream bound: a bug to see
            self.stats.rounds["error"] += 1
            logger.error("gossip sync message to %s not sent: %s", peer, exc)
