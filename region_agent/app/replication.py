"""The adapter between the replicated store and gossip: what leaves, what arrives, and how.

- **Out, fresh:** every entry this agent writes itself (copy health, ACME challenges, a zone file
  import) is broadcast as a gossip user message, piggybacked on the membership's packets, so it
  reaches every agent in O(log N) gossip hops. A batch larger than :data:`MAX_BROADCAST_BATCH`, a
  write while :data:`MAX_QUEUED` broadcasts still wait, or an entry too big for a datagram, is not
  broadcast: anti-entropy rounds start at once instead (a zone import of 10,000 projects, or the
  first 10,000 check results, must not flood the broadcast queue).
- **In, fresh:** user messages with the ``s:`` key prefix are decoded and merged; every arrival of
  one loop turn goes through one :meth:`Store.merge` (one zone recompilation per burst).
- **Anti-entropy:** :class:`StoreReplica` is the :class:`region_agent.gossip.sync.Replica` for the store:
  exports whole buckets, encoded off the event loop; decodes arriving entries off the loop and
  merges them in slices, so a catch-up of a large store never stalls DNS answers.

Every entry from a peer goes through the store's merge policy (owners enforced, schema version,
clock drift, and the writer's signature, :mod:`region_agent.state.signatures`); refused entries are
counted there by reason and logged here, at most once per reason every :data:`LOG_EVERY` seconds.
Signatures of an anti-entropy batch are checked in a worker thread (88 µs each: 20,000 entries are
1.8 s of CPU that must not stall DNS), a broadcast's on the loop (one at a time). An entry whose
signer's certificate has not arrived yet (``unknown-signer``) waits, bounded, and is merged again
when a certificate entry applies.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import time
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter

from region_agent.gossip.messages import MAX_USER_PAYLOAD, User
from region_agent.state.model import Kind, ModelError
from region_agent.state.store import Entry, Rejected, RejectReason, Store, bucket_of, entry_from_json, entry_to_json

logger = logging.getLogger("region_agent.gossip")

USER_PREFIX = "s:"
MAX_BROADCAST_BATCH = 64     # local entries per store change broadcast one by one; above it, anti-entropy
MAX_QUEUED = 256             # broadcasts already queued past which local changes go to anti-entropy instead
MERGE_SLICE = 500            # entries per Store.merge call while catching up (a loop turn between slices: ~8 ms)
MAX_PENDING = 10_000         # entries waiting for their signer's certificate
LOG_EVERY = 10.0             # seconds between two log lines about refused entries of one reason
VERIFY_THREADS = min(4, os.cpu_count() or 1)   # signature checks of a catch-up, spread over the cores
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def encode_entry(entry: Entry) -> bytes:
    return _ENCODE(entry_to_json(entry)).encode()


def decode_entry(raw: bytes) -> Entry:
    """An entry from a peer; raises :class:`ModelError` for anything malformed."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"entry is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelError("entry is not an object")
    return entry_from_json(data)


def broadcast_key(entry: Entry) -> str:
    """The dedup key of one version of one entry (every agent derives the same one)."""
    h = hashlib.blake2b(digest_size=12)
    h.update("\x1f".join(entry.key).encode())
    h.update(entry.version.hlc.to_bytes(10, "big"))
    h.update(entry.version.writer.encode())
    return USER_PREFIX + h.hexdigest()


class ReplicationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.broadcasts = Counter("region_agent_gossip_store_broadcasts", "Local store entries broadcast by gossip",
                                  registry=registry)
        self.received = Counter("region_agent_gossip_store_entries_received",
                                "Store entries received from peers, by path (broadcast or sync)", ["path"],
                                registry=registry)
        self.undecodable = Counter("region_agent_gossip_store_undecodable",
                                   "Store entries from peers that did not decode (malformed or another schema)",
                                   registry=registry)
        self.oversized = Counter("region_agent_gossip_store_not_broadcast",
                                 "Local store changes left to anti-entropy (batch too large or entry too big)",
                                 registry=registry)


def _decode_all(raw: Sequence[bytes]) -> tuple[list[Entry], list[str]]:
    entries: list[Entry] = []
    errors: list[str] = []
    for item in raw:
        try:
            entries.append(decode_entry(item))
        except ModelError as exc:
            errors.append(str(exc))
    return entries, errors


class StoreReplica:
    """The store as gossip sees it (see the module docstring)."""

    def __init__(self, store: Store, registry: CollectorRegistry) -> None:
        self.store = store
        self.metrics = ReplicationMetrics(registry)
        self._broadcast: Callable[[str, bytes], None] | None = None
        self._sync_now: Callable[[int], None] | None = None
        self._queued: Callable[[], int] = lambda: 0
        self._merging = False
        self._inbox: list[Entry] = []
        self._flush: asyncio.Handle | None = None
        self._pending: OrderedDict[tuple[tuple[str, ...], int, str], Entry] = OrderedDict()
        self._unlogged: Tally[str] = Tally()
        self._logged_at: dict[str, float] = {}
        store.subscribe(self._on_change)

    def attach(self, broadcast: Callable[[str, bytes], None], sync_now: Callable[[int], None],
               queued: Callable[[], int] = lambda: 0) -> None:
        """Start spreading local writes (before this, nothing is sent: nobody is there to hear it)."""
        self._broadcast = broadcast
        self._sync_now = sync_now
        self._queued = queued

    # --- out ----------------------------------------------------------------------------------

    def _on_change(self, changed: list[Entry]) -> None:
        if self._merging or self._broadcast is None or self.store.dropping:
            return
        if len(changed) > MAX_BROADCAST_BATCH or self._queued() >= MAX_QUEUED:
            # A big batch, or a stream of single writes (10,000 first check results) outrunning the
            # gossip: the entries wait for anti-entropy, which moves whole buckets in a few rounds.
            self.metrics.oversized.inc(len(changed))
            assert self._sync_now is not None
            self._sync_now(3)
            return
        too_big = 0
        for entry in changed:
            payload = encode_entry(entry)
            if len(payload) > MAX_USER_PAYLOAD:
                too_big += 1
                continue
            self._broadcast(broadcast_key(entry), payload)
            self.metrics.broadcasts.inc()
        if too_big:
            self.metrics.oversized.inc(too_big)
            assert self._sync_now is not None
            self._sync_now(3)

    # --- in, broadcast ------------------------------------------------------------------------

    def user_message(self, message: User) -> bool:
        """Take a store entry broadcast; False when the message is not one (another prefix)."""
        if not message.key.startswith(USER_PREFIX):
            return False
        try:
            entry = decode_entry(message.payload)
        except ModelError as exc:
            self.metrics.undecodable.inc()
            logger.debug("undecodable store broadcast from %s: %s", message.origin, exc)
            return True
        self.metrics.received.labels("broadcast").inc()
        self._inbox.append(entry)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._flush_inbox)
        return True

    def _flush_inbox(self) -> None:
        self._flush = None
        batch, self._inbox = self._inbox, []
        self._merge_batch(batch)

    def _merge_batch(self, batch: list[Entry], origin: str = "gossip", *, verified: bool = False) -> int:
        self._merging = True
        try:
            result = self.store.merge(batch, verified=verified)
        finally:
            self._merging = False
        self._refused(result.rejected, origin)
        if self._pending and any(e.key[0] == Kind.CERT.value for e in result.applied):
            self.retry_pending()
        return len(result.applied)

    def _refused(self, rejected: Sequence[Rejected], origin: str) -> None:
        """Keep what waits for a certificate; log the rest, rate-limited (a flood logs one line per reason)."""
        for problem in rejected:
            if problem.reason is RejectReason.UNKNOWN_SIGNER:
                entry = problem.entry
                self._pending[(entry.key, entry.version.hlc, entry.version.writer)] = entry
                while len(self._pending) > MAX_PENDING:
                    self._pending.popitem(last=False)
                continue
            self._unlogged[problem.reason.value] += 1
            now = time.monotonic()
            if now - self._logged_at.get(problem.reason.value, -LOG_EVERY) >= LOG_EVERY:
                self._logged_at[problem.reason.value] = now
                logger.warning("refused %d store entr%s (%s) via %s; last: %s", self._unlogged[problem.reason.value],
                               "y" if self._unlogged[problem.reason.value] == 1 else "ies", problem.reason.value,
                               origin, problem.detail[:300])
                self._unlogged[problem.reason.value] = 0

    def retry_pending(self) -> int:
        """Merge again what waited for a certificate (one arrived); returns how many applied."""
        batch = list(self._pending.values())
        self._pending.clear()
        return self._merge_batch(batch, "pending") if batch else 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    # --- anti-entropy (region_agent.gossip.sync.Replica) -------------------------------------------------

    def digest(self) -> bytes:
        return bytes.fromhex(self.store.digest())

    def bucket_digests(self) -> list[bytes]:
        return [d.to_bytes(16, "big") for d in self.store.bucket_digests()]

    async def export(self, buckets: Sequence[int], budget: int) -> tuple[list[bytes], int]:
        if not buckets:
            return [], 0
        by_bucket: dict[int, list[Entry]] = {}
        for entry in self.store.entries_in_buckets(buckets):   # immutable entries: safe to encode in a thread
            by_bucket.setdefault(bucket_of(entry.key), []).append(entry)
        encoded, covered = await asyncio.to_thread(_encode_buckets, [by_bucket.get(b, []) for b in buckets], budget)
        return self._certificates_for(encoded) + encoded, covered

    def _certificates_for(self, encoded: list[bytes]) -> list[bytes]:
        """The certificate entries of every signer in an export, so the receiver can check each batch on its
        own: a batch whose certificate sat in a bucket beyond the budget would be refused every round, and
        the round would never get past it."""
        wanted = {s for s in (_signer_of(raw) for raw in encoded) if s}
        out = []
        for fingerprint in wanted:
            entry = self.store.certificate_entry(fingerprint)
            if entry is not None:
                out.append(encode_entry(entry))
        return out

    async def merge(self, entries: Sequence[bytes], origin: str) -> int:
        decoded = await self._decode(entries, origin)
        return await self._merge_decoded(decoded, origin)

    async def replace(self, entries: Sequence[bytes], origin: str, buckets: Sequence[int]) -> int:
        decoded = await self._decode(entries, origin)
        await self._merge_decoded(decoded, origin)
        if not buckets:
            return 0
        # Certificates are never dropped: they leave only by revocation (and ride along out of their buckets).
        held = {e.key for e in decoded}
        lacked = {e.key for e in self.store.entries_in_buckets(buckets)
                  if e.key not in held and e.key[0] != Kind.CERT.value}
        gone = self.store.drop(lambda e: e.key in lacked) if lacked else []
        return len(gone)

    async def _decode(self, entries: Sequence[bytes], origin: str) -> list[Entry]:
        decoded, errors = await asyncio.to_thread(_decode_all, entries)
        self.metrics.received.labels("sync").inc(len(entries))
        if errors:
            self.metrics.undecodable.inc(len(errors))
            logger.warning("%d store entries from %s did not decode; first: %s", len(errors), origin, errors[0][:200])
        return decoded

    async def _merge_decoded(self, decoded: list[Entry], origin: str) -> int:
        # Signatures off the loop; certificates of the batch are learned there first.
        good, rejected = await asyncio.to_thread(functools.partial(self.store.verify, threads=VERIFY_THREADS),
                                                 decoded)
        self.store.count_rejected(rejected)
        self._refused(rejected, origin)
        applied = 0
        for start in range(0, len(good), MERGE_SLICE):
            if start:
                await asyncio.sleep(0)   # let DNS answers through between slices
            applied += self._merge_batch(good[start:start + MERGE_SLICE], origin, verified=True)
        return applied


def _signer_of(raw: bytes) -> str:
    """The signer field of an encoded entry, without decoding it (the encoding ends with signer and sig)."""
    at = raw.rfind(b'"signer":"')
    if at < 0:
        return ""
    end = raw.find(b'"', at + 10)
    return raw[at + 10:end].decode("ascii", "replace") if end > 0 else ""


def _encode_buckets(buckets: list[list[Entry]], budget: int) -> tuple[list[bytes], int]:
    """Whole buckets until the budget is spent (at least one, so a huge bucket still moves); and how many."""
    out: list[bytes] = []
    used = 0
    for index, entries in enumerate(buckets):
        encoded = [encode_entry(e) for e in entries]
        size = sum(len(e) for e in encoded)
        if index and used + size > budget:
            return out, index
        out.extend(encoded)
        used += size
    return out, len(buckets)
