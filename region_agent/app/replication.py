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
clock drift); refused entries are counted there by reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter

from region_agent.gossip.messages import MAX_USER_PAYLOAD, User
from region_agent.state.model import ModelError
from region_agent.state.store import Entry, Store, bucket_of, entry_from_json, entry_to_json

logger = logging.getLogger("region_agent.gossip")

USER_PREFIX = "s:"
MAX_BROADCAST_BATCH = 64     # local entries per store change broadcast one by one; above it, anti-entropy
MAX_QUEUED = 256             # broadcasts already queued past which local changes go to anti-entropy instead
MERGE_SLICE = 2_000          # entries per Store.merge call while catching up (a loop turn between slices)
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
        store.subscribe(self._on_change)

    def attach(self, broadcast: Callable[[str, bytes], None], sync_now: Callable[[int], None],
               queued: Callable[[], int] = lambda: 0) -> None:
        """Start spreading local writes (before this, nothing is sent: nobody is there to hear it)."""
        self._broadcast = broadcast
        self._sync_now = sync_now
        self._queued = queued

    # --- out ----------------------------------------------------------------------------------

    def _on_change(self, changed: list[Entry]) -> None:
        if self._merging or self._broadcast is None:
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

    def _merge_batch(self, batch: list[Entry]) -> int:
        self._merging = True
        try:
            return len(self.store.merge(batch).applied)
        finally:
            self._merging = False

    # --- anti-entropy (region_agent.gossip.sync.Replica) -------------------------------------------------

    def digest(self) -> bytes:
        return bytes.fromhex(self.store.digest())

    def bucket_digests(self) -> list[bytes]:
        return [d.to_bytes(16, "big") for d in self.store.bucket_digests()]

    async def export(self, buckets: Sequence[int], budget: int) -> tuple[list[bytes], bool]:
        if not buckets:
            return [], True
        by_bucket: dict[int, list[Entry]] = {}
        for entry in self.store.entries_in_buckets(buckets):   # immutable entries: safe to encode in a thread
            by_bucket.setdefault(bucket_of(entry.key), []).append(entry)
        return await asyncio.to_thread(_encode_buckets, [by_bucket.get(b, []) for b in buckets], budget)

    async def merge(self, entries: Sequence[bytes], origin: str) -> int:
        decoded, errors = await asyncio.to_thread(_decode_all, entries)
        self.metrics.received.labels("sync").inc(len(entries))
        if errors:
            self.metrics.undecodable.inc(len(errors))
            logger.warning("%d store entries from %s did not decode; first: %s", len(errors), origin, errors[0][:200])
        applied = 0
        for start in range(0, len(decoded), MERGE_SLICE):
            if start:
                await asyncio.sleep(0)   # let DNS answers through between slices
            applied += self._merge_batch(decoded[start:start + MERGE_SLICE])
        return applied


def _encode_buckets(buckets: list[list[Entry]], budget: int) -> tuple[list[bytes], bool]:
    """Whole buckets until the budget is spent (at least one, so a huge bucket still moves)."""
    out: list[bytes] = []
    used = 0
    for index, entries in enumerate(buckets):
        encoded = [encode_entry(e) for e in entries]
        size = sum(len(e) for e in encoded)
        if index and used + size > budget:
            return out, False
        out.extend(encoded)
        used += size
    return out, True
