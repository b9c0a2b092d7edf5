"""The replicated store: versioned entries, deterministic merge, tombstones and a digest.

Every agent holds a full copy. An entry is ``(key, value or tombstone, version)`` where the
version is ``(hlc, writer)``; the entry with the greater version wins, everywhere, whatever
order updates arrive in (last writer wins on a hybrid logical clock, ties broken by writer
id), so two stores that have seen the same entries are equal. Deletes are tombstones that
win like writes and are dropped after ``tombstone_ttl`` so the store does not grow forever.

The digest is the sum, modulo 2**128, of one hash per entry (key, version and value), kept per
bucket (the first byte of a hash of the key): adding or replacing an entry updates it in O(1),
two stores compare in one message, and differing buckets say which entries to exchange. Two
entries of one version with different values (only their writer could make them) are ordered
by the hash of the value, so every store keeps the same one.

**Signatures.** In a cluster every entry carries its writer's signature over (key, version,
writer, value) (:func:`signed_bytes`), made with the writer agent's identity key
(:class:`region_agent.base.identity.Signer`, given as ``signer``) when the entry is written, and
checked by ``verifier`` (:class:`region_agent.state.signatures.EntryVerifier`) on merge, before
anything applies. An entry already held at the same or a newer version is stale and skips the
check: re-offered entries cost nothing. :meth:`Store.verify` lets a caller check a large batch
off the event loop and merge it with ``verified=True``.

Writes come in batches: :meth:`Store.put_many` (local) and :meth:`Store.merge` (from peers)
apply a whole batch and then notify each listener once with every entry that changed, so
a reload of 1,000 projects costs one recompilation, not 1,000.

Merge policy: each entry of a batch is validated first (key shape, record type, writer id,
owner, schema, clock drift); a rejected entry is reported in :class:`MergeResult` with its
reason and counted (``region_agent_state_merge_rejected_total{reason}``), and every other
entry still applies. One bad entry from a peer must not hold back the good ones, and since
merge is idempotent and order-free, a later anti-entropy round repairs what was refused
once the sender is fixed. A local batch (``put_many``) is all-or-nothing instead: a bad
local write is a bug of the caller and raises before anything changes.

Tombstones of control-owned keys (regions, projects, fences: what the platform configures and a
returning agent must never resurrect) are kept :data:`CONTROL_TOMBSTONE_TTL_SECONDS` (30 days:
the *horizon*; an agent away longer, or a snapshot older, must not offer its state again, see
:mod:`region_agent.state.persist`); the others (copy health its owner rewrites, ACME records that
expire on their own, certificates) :data:`TOMBSTONE_TTL_SECONDS` (a day). They are swept every
:data:`TOMBSTONE_SWEEP_SECONDS` by the supervisor calling :meth:`Store.expire_tombstones`.

This module does no I/O and never awaits: callers own locking-free single-loop access.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge

from region_agent.base.identity import ENTRY
from region_agent.state.hlc import ClockDriftError, HybridClock, physical_ms
from region_agent.state.model import (
    SCHEMA_VERSION,
    STANDALONE,
    Certificate,
    Challenge,
    CopyHealth,
    Fence,
    Idempotency,
    Key,
    Kind,
    ModelError,
    Project,
    Region,
    Value,
    check_key,
    may_write,
    value_matches,
    writer_role,
)

BUCKETS = 256
_CANONICAL = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode
_MOD = 1 << 128
TOMBSTONE_TTL_SECONDS = 86_400.0
CONTROL_TOMBSTONE_TTL_SECONDS = 30 * 86_400.0
_CONTROL_KINDS = frozenset((Kind.REGION.value, Kind.PROJECT.value, Kind.FENCE.value))
# Kinds the zone does not answer from: they change neither the compiled zone nor its serial.
OUTSIDE_THE_ZONE = frozenset((Kind.CERT.value, Kind.IDEM.value))
TOMBSTONE_SWEEP_SECONDS = 600.0


@dataclass(frozen=True, slots=True, order=True)
class Version:
    hlc: int
    writer: str


@dataclass(frozen=True, slots=True)
class Entry:
    key: Key
    value: Value | None  # None is a tombstone
    version: Version
    signer: str = ""          # fingerprint of the writer's identity certificate ("" unsigned)
    signature: bytes = b""    # ECDSA over signed_bytes(), in the ENTRY context

    @property
    def is_tombstone(self) -> bool:
        return self.value is None


class EntrySigner(Protocol):
    """This agent's identity key (:class:`region_agent.base.identity.Signer`)."""

    @property
    def fingerprint(self) -> str: ...

    def sign(self, context: bytes, data: bytes) -> bytes: ...


class EntryVerifier(Protocol):
    def __call__(self, entry: Entry) -> Rejected | None:
        """None when ``entry``'s signature is good; else why not (changes nothing but caches)."""
        ...


class SignatureJob(Protocol):
    entry: Entry

    def passes(self) -> bool: ...

    def refusal(self) -> Rejected: ...


@runtime_checkable
class BatchVerifier(Protocol):
    """A verifier that can leave the signature check itself for later (to spread a batch over cores)."""

    def __call__(self, entry: Entry) -> Rejected | None: ...

    def prepare(self, entry: Entry) -> Rejected | SignatureJob | None: ...


def value_bytes(value: Value | None) -> bytes:
    """The canonical bytes of a value (what the signature and the digest cover); empty for a tombstone."""
    if value is None:
        return b""
    from region_agent.state.model import encode_value

    return _CANONICAL(encode_value(value)).encode()


def signed_bytes(key: Key, version: Version, value: Value | None) -> bytes:
    """What a writer signs: the key, the version (HLC and writer id) and the value, unambiguously."""
    return b"\x00".join((_key_bytes(key), version.hlc.to_bytes(10, "big"), version.writer.encode(),
                         b"\x00" if value is None else b"\x01" + value_bytes(value)))


def _value_hash(value: Value | None) -> bytes:
    return hashlib.blake2b(value_bytes(value), digest_size=16).digest()


class OwnershipError(PermissionError):
    """A writer tried to change a key it does not own."""


class RejectReason(enum.StrEnum):
    """Why :meth:`Store.merge` refused an entry (the ``reason`` label of the counter)."""

    BAD_KEY = "bad-key"  # unknown kind or wrong shape
    BAD_VALUE = "bad-value"  # not the record type of the key's kind, or names another key
    BAD_WRITER = "bad-writer"  # a writer id that is not <role>/<node>
    STANDALONE_WRITER = "standalone-writer"  # standalone agents are never replicated
    NOT_OWNER = "not-owner"  # the writer does not hold the key's owner role
    CLOCK_DRIFT = "clock-drift"  # an HLC too far ahead of our wall clock
    UNSIGNED = "unsigned"  # no signature where one is required
    UNKNOWN_SIGNER = "unknown-signer"  # no trusted certificate with the signer's fingerprint (yet)
    BAD_SIGNER = "bad-signer"  # the certificate does not cover the writer, or was not valid when it signed
    BAD_SIGNATURE = "bad-signature"  # the signature does not verify
    REVOKED = "revoked"  # signed by a revoked certificate


@dataclass(frozen=True, slots=True)
class Rejected:
    entry: Entry
    reason: RejectReason
    detail: str


@dataclass(frozen=True, slots=True)
class MergeResult:
    """What a merge did: entries applied (one per key, the winner), refused, and already known."""

    applied: list[Entry]
    rejected: list[Rejected]
    stale: int


def check_remote(entry: Entry, clock: HybridClock) -> Rejected | None:
    """Validate one entry from a peer without changing anything; None when it may apply."""
    try:
        check_key(entry.key)
    except ModelError as exc:
        return Rejected(entry, RejectReason.BAD_KEY, str(exc))
    if entry.value is not None and not value_matches(entry.key, entry.value):
        detail = f"{type(entry.value).__name__} is not a record for {entry.key!r}"
        return Rejected(entry, RejectReason.BAD_VALUE, detail)
    writer = entry.version.writer
    try:
        role = writer_role(writer)
    except ModelError as exc:
        return Rejected(entry, RejectReason.BAD_WRITER, str(exc))
    if role == STANDALONE:
        return Rejected(entry, RejectReason.STANDALONE_WRITER, f"writer {writer} is a standalone agent")
    if not may_write(writer, entry.key):
        return Rejected(entry, RejectReason.NOT_OWNER, f"writer {writer} does not own {entry.key!r}")
    try:
        clock.check(entry.version.hlc)
    except ClockDriftError as exc:
        return Rejected(entry, RejectReason.CLOCK_DRIFT, str(exc))
    return None


def _key_bytes(key: Key) -> bytes:
    return "\x1f".join(key).encode()


def bucket_of(key: Key) -> int:
    return hashlib.blake2b(_key_bytes(key), digest_size=1).digest()[0]


def _entry_hash(entry: Entry) -> int:
    h = hashlib.blake2b(digest_size=16)
    h.update(_key_bytes(entry.key))
    h.update(b"\x00")
    h.update(entry.version.hlc.to_bytes(10, "big"))
    h.update(entry.version.writer.encode())
    h.update(b"\x00" if entry.value is None else b"\x01" + _value_hash(entry.value))
    return int.from_bytes(h.digest(), "big")


def newer(entry: Entry, current: Entry | None) -> bool:
    """Whether ``entry`` wins over ``current``: a greater version; at an equal version, the greater value hash."""
    if current is None or entry.version > current.version:
        return True
    return (entry.version == current.version and entry.value != current.value
            and _value_hash(entry.value) > _value_hash(current.value))


class StateView(Protocol):
    """The live records by kind: what the zone compiler and the checks read."""

    @property
    def regions(self) -> Mapping[str, Region]: ...

    @property
    def projects(self) -> Mapping[str, Project]: ...

    @property
    def copies(self) -> Mapping[tuple[str, str], CopyHealth]: ...

    @property
    def challenges(self) -> Mapping[str, Mapping[bytes, Challenge]]: ...

    @property
    def fenced(self) -> Mapping[str, Fence]: ...

    @property
    def newest_hlc(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable copy of the live records (a :class:`StateView` that later writes do not change)."""

    regions: dict[str, Region]
    projects: dict[str, Project]
    copies: dict[tuple[str, str], CopyHealth]
    newest_hlc: int
    digest: str
    challenges: dict[str, dict[bytes, Challenge]] = field(default_factory=dict)
    fenced: dict[str, Fence] = field(default_factory=dict)


Listener = Callable[[list[Entry]], None]


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.rejected = Counter("region_agent_state_merge_rejected", "Entries from peers refused by merge",
                                ["reason"], registry=registry)
        self.applied = Counter("region_agent_state_merge_applied", "Entries from peers that changed the store",
                               registry=registry)
        self.expired = Counter("region_agent_state_tombstones_expired", "Tombstones dropped after their TTL",
                               registry=registry)
        self.tombstones = Gauge("region_agent_state_tombstones", "Tombstones held", registry=registry)
        for reason in RejectReason:
            self.rejected.labels(reason.value)


class Store:
    def __init__(self, *, writer: str, clock: HybridClock, tombstone_ttl: float = TOMBSTONE_TTL_SECONDS,
                 control_tombstone_ttl: float = CONTROL_TOMBSTONE_TTL_SECONDS,
                 registry: CollectorRegistry | None = None, signer: EntrySigner | None = None,
                 verifier: EntryVerifier | None = None) -> None:
        writer_role(writer)
        self.writer = writer
        self.clock = clock
        self.signer = signer        # signs every local write (a cluster agent); None: unsigned
        self.verifier = verifier    # checks every remote entry's signature; None: not checked
        self.dropping = False       # set while listeners hear of drop(): local removals, not writes
        self.tombstone_ttl_ms = int(tombstone_ttl * 1000)
        self.control_tombstone_ttl_ms = int(control_tombstone_ttl * 1000)
        self.metrics = StoreMetrics(registry if registry is not None else CollectorRegistry())
        self._entries: dict[Key, Entry] = {}
        self._hashes: dict[Key, tuple[int, int]] = {}  # key -> (bucket, hash of its entry), for the digest
        self._tombstones: dict[Key, Entry] = {}
        self._bucket_sums = [0] * BUCKETS
        self._listeners: list[Listener] = []
        # Live records by kind, kept in step with _entries so a reader never scans or copies
        # the whole store. Read-only for everyone else (they are the StateView).
        self._regions: dict[str, Region] = {}
        self._projects: dict[str, Project] = {}
        self._copies: dict[tuple[str, str], CopyHealth] = {}
        self._challenges: dict[str, dict[bytes, Challenge]] = {}  # name → TXT rdata → record
        self._fenced: dict[str, Fence] = {}  # region → its fence
        self._certs: dict[str, Certificate] = {}  # fingerprint → identity certificate
        self._cert_keys: dict[str, Key] = {}  # fingerprint → the key of its entry
        self._idempotency: dict[str, Idempotency] = {}  # key hash → a control write's answer
        self._newest_hlc = 0

    # --- reads --------------------------------------------------------------------------

    def get(self, key: Key) -> Value | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def entry(self, key: Key) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def keys_of(self, kind: Kind) -> list[Key]:
        return [k for k, e in self._entries.items() if k[0] == kind.value and e.value is not None]

    def bucket_digests(self) -> tuple[int, ...]:
        return tuple(self._bucket_sums)

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for total in self._bucket_sums:
            h.update(total.to_bytes(16, "big"))
        return h.hexdigest()

    def entries_in_buckets(self, buckets: Iterable[int]) -> list[Entry]:
        wanted = set(buckets)
        entries = self._entries
        return [entries[key] for key, (bucket, _) in self._hashes.items() if bucket in wanted]

    @property
    def regions(self) -> Mapping[str, Region]:
        return self._regions

    @property
    def projects(self) -> Mapping[str, Project]:
        return self._projects

    @property
    def copies(self) -> Mapping[tuple[str, str], CopyHealth]:
        return self._copies

    @property
    def challenges(self) -> Mapping[str, Mapping[bytes, Challenge]]:
        return self._challenges

    @property
    def fenced(self) -> Mapping[str, Fence]:
        return self._fenced

    @property
    def certificates(self) -> Mapping[str, Certificate]:
        """Identity certificates by fingerprint (every writer's, for checking what it signed)."""
        return self._certs

    @property
    def idempotency(self) -> Mapping[str, Idempotency]:
        return self._idempotency

    def certificate_entry(self, fingerprint: str) -> Entry | None:
        """The entry holding the certificate with ``fingerprint``, or None."""
        key = self._cert_keys.get(fingerprint)
        return None if key is None else self._entries.get(key)

    @property
    def newest_hlc(self) -> int:
        """The greatest version this store has applied (tombstones included), certificates aside."""
        return self._newest_hlc

    def snapshot(self) -> Snapshot:
        return Snapshot(dict(self._regions), dict(self._projects), dict(self._copies), self._newest_hlc,
                        self.digest(), {name: dict(values) for name, values in self._challenges.items()},
                        dict(self._fenced))

    # --- local writes -------------------------------------------------------------------

    def put(self, key: Key, value: Value) -> Entry | None:
        """Write ``value`` as this store's writer; returns None when nothing changed."""
        changed = self.put_many([(key, value)])
        return changed[0] if changed else None

    def delete(self, key: Key) -> Entry | None:
        changed = self.put_many([(key, None)])
        return changed[0] if changed else None

    def put_many(self, items: Iterable[tuple[Key, Value | None]], *, writer: str | None = None) -> list[Entry]:
        """Write a batch as this store's writer (``None`` deletes); returns the entries that changed.

        ``writer`` writes as another role this agent holds (``acme/<region>.<node>`` for what a
        signed UPDATE asked); it must own every key like any writer.

        The whole batch is checked before anything changes (a bad key, record or owner
        raises and the store stays as it was); listeners then hear once, with every change.
        A key given twice takes its last value; a value equal to the current one makes no
        new version (no churn in gossip or the zone). Signing costs ~35 µs an entry: a caller
        with a large batch on the event loop uses :meth:`prepare`, :meth:`sign` in a worker
        thread, then :meth:`apply_local`.
        """
        return self.apply_local(self.sign(self.prepare(items, writer=writer)))

    def prepare(self, items: Iterable[tuple[Key, Value | None]], *, writer: str | None = None) -> list[Entry]:
        """The new versions a batch would write, checked and unsigned; changes nothing (raises like put_many)."""
        batch: dict[Key, Value | None] = {}
        if writer is None:
            writer = self.writer
        else:
            writer_role(writer)
        for key, value in items:
            check_key(key)
            if not may_write(writer, key):
                raise OwnershipError(f"writer {writer} does not own {key!r}")
            if value is not None and not value_matches(key, value):
                raise ModelError(f"{type(value).__name__} is not a record for {key!r}")
            batch[key] = value
        out: list[Entry] = []
        for key, value in batch.items():
            current = self._entries.get(key)
            if current is None and value is None:
                continue
            if current is not None and current.value == value:
                continue
            out.append(Entry(key, value, Version(self.clock.now(), writer)))
        return out

    def sign(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` signed with this store's key (unchanged without one); pure, safe in a worker thread."""
        signer = self.signer
        if signer is None:
            return entries
        return [dataclasses.replace(e, signer=signer.fingerprint,
                                    signature=signer.sign(ENTRY, signed_bytes(e.key, e.version, e.value)))
                for e in entries]

    def apply_local(self, entries: list[Entry]) -> list[Entry]:
        """Apply prepared (and signed) local entries that still win; listeners hear once. Returns them."""
        changed = [entry for entry in entries if newer(entry, self._entries.get(entry.key))]
        for entry in changed:
            self._apply(entry)
        if changed:
            self._notify(changed)
        return changed

    # --- remote entries -----------------------------------------------------------------

    def verify(self, entries: Iterable[Entry], *, threads: int = 1) -> tuple[list[Entry], list[Rejected]]:
        """Check entries from a peer (shape, owner, clock, signature) without changing the store:
        the good ones, to :meth:`merge` with ``verified=True``, and the refused ones, not yet counted.

        Safe to call from a worker thread while the loop runs: it only reads the store. Entries
        already held at the same or a newer version pass without a signature check (merge drops
        them as stale). With ``threads`` > 1 the signature checks of a large batch run on that many
        threads (OpenSSL releases the GIL while it verifies: 1.7x on two cores).
        """
        good: list[Entry] = []
        refused: list[Rejected] = []
        jobs: list[SignatureJob] = []
        verifier = self.verifier
        batch = isinstance(verifier, BatchVerifier)
        # Certificates first: the entries they sign may follow in the same batch.
        for entry in sorted(entries, key=lambda e: e.key[0] != Kind.CERT.value):
            problem = check_remote(entry, self.clock)
            if problem is None and verifier is not None and newer(entry, self._entries.get(entry.key)):
                if batch:
                    assert isinstance(verifier, BatchVerifier)
                    outcome = verifier.prepare(entry)
                    if outcome is not None and not isinstance(outcome, Rejected):
                        jobs.append(outcome)
                        continue
                    problem = outcome
                else:
                    problem = verifier(entry)
            if problem is None:
                good.append(entry)
            else:
                refused.append(problem)
        if threads > 1 and len(jobs) >= PARALLEL_VERIFY_MIN:
            size = -(-len(jobs) // threads)
            with ThreadPoolExecutor(threads, thread_name_prefix="verify") as pool:
                results = [ok for part in pool.map(_passes, [jobs[i:i + size] for i in range(0, len(jobs), size)])
                           for ok in part]
        else:
            results = _passes(jobs)
        for job, ok in zip(jobs, results, strict=True):
            if ok:
                good.append(job.entry)
            else:
                refused.append(job.refusal())
        return good, refused

    def count_rejected(self, rejected: Iterable[Rejected]) -> None:
        for problem in rejected:
            self.metrics.rejected.labels(problem.reason.value).inc()

    def merge(self, entries: Iterable[Entry], *, verified: bool = False) -> MergeResult:
        """Apply a batch of entries from a peer (see the merge policy in the module docstring).

        Every entry is validated (and its signature checked, unless ``verified``: :meth:`verify`
        did it) before any applies; per key the winning entry of the batch is the candidate, and
        it applies when it wins over what the store holds. Listeners hear once, with exactly the
        applied entries.
        """
        rejected: list[Rejected]
        if verified:
            good, rejected = list(entries), []
        else:
            good, rejected = self.verify(entries)
        winners: dict[Key, Entry] = {}
        for entry in good:
            if newer(entry, winners.get(entry.key)):
                winners[entry.key] = entry
        applied: list[Entry] = []
        stale = 0
        for key, entry in winners.items():
            self.clock.advance(entry.version.hlc)  # checked in validation: applying never raises
            if not newer(entry, self._entries.get(key)):
                stale += 1
                continue
            self._apply(entry)
            applied.append(entry)
        self.count_rejected(rejected)
        self.metrics.applied.inc(len(applied))
        if applied:
            self._notify(applied)
        return MergeResult(applied, rejected, stale)

    def expire_tombstones(self, now_wall_ms: int | None = None) -> int:
        """Drop tombstones older than the TTL (but the newest entry); returns how many were dropped.

        Listeners are not told: a tombstone is in no index, so nothing they read changes.
        """
        now = self.clock.wall_ms() if now_wall_ms is None else now_wall_ms
        cutoff = now - self.tombstone_ttl_ms
        control_cutoff = now - self.control_tombstone_ttl_ms
        # The newest entry stays, tombstone or not: it is what the serial counts from, so an
        # expiry (here, or before a snapshot was saved) never turns the serial back.
        newest = self._newest_hlc
        if any(e.version.hlc == newest for e in self._tombstones.values()) and not any(
                e.version.hlc == newest for e in self._entries.values() if e.value is not None):
            keep = newest   # a tombstone is the newest entry: it stays
        else:
            keep = -1
        old = [e for e in self._tombstones.values()
               if physical_ms(e.version.hlc) < (control_cutoff if e.key[0] in _CONTROL_KINDS else cutoff)
               and e.version.hlc != keep]
        for entry in old:
            del self._entries[entry.key]
            del self._tombstones[entry.key]
            bucket, digest = self._hashes.pop(entry.key)
            self._bucket_sums[bucket] = (self._bucket_sums[bucket] - digest) % _MOD
        self.metrics.expired.inc(len(old))
        self.metrics.tombstones.set(len(self._tombstones))
        return len(old)

    def drop(self, predicate: Callable[[Entry], bool]) -> list[Entry]:
        """Remove the entries ``predicate`` picks, leaving no tombstone: what this agent's own policy no
        longer accepts (entries signed by a revoked certificate). Every agent under the same policy drops
        the same ones, so digests still converge; a peer's copy of them is refused on merge. Listeners hear
        the removals as tombstones while :attr:`dropping` is set (the replica does not broadcast them)."""
        gone = [e for e in self._entries.values() if predicate(e)]
        for entry in gone:
            del self._entries[entry.key]
            self._tombstones.pop(entry.key, None)
            bucket, digest = self._hashes.pop(entry.key)
            self._bucket_sums[bucket] = (self._bucket_sums[bucket] - digest) % _MOD
            self._index(Entry(entry.key, None, entry.version))
        if gone:
            self.dropping = True
            try:
                self._notify([Entry(e.key, None, e.version) for e in gone])
            finally:
                self.dropping = False
        return gone

    # --- notifications ------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(changed entries)`` after every change; must not block or await."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _notify(self, changed: list[Entry]) -> None:
        for listener in list(self._listeners):
            listener(changed)

    def _apply(self, entry: Entry) -> None:
        key = entry.key
        current = self._entries.get(key)
        known = self._hashes.get(key)
        bucket = bucket_of(key) if known is None else known[0]
        digest = _entry_hash(entry)
        total = self._bucket_sums[bucket] + digest - (0 if known is None else known[1])
        self._bucket_sums[bucket] = total % _MOD
        self._hashes[key] = (bucket, digest)
        self._entries[key] = entry
        if entry.value is None:
            self._tombstones[entry.key] = entry
        elif current is not None and current.value is None:
            del self._tombstones[entry.key]
        self._index(entry)
        if key[0] not in OUTSIDE_THE_ZONE:   # the serial follows what the zone answers
            self._newest_hlc = max(self._newest_hlc, entry.version.hlc)

    def _index(self, entry: Entry) -> None:
        key, value = entry.key, entry.value
        if key[0] == Kind.REGION.value:
            _set_or_pop(self._regions, key[1], value)
        elif key[0] == Kind.PROJECT.value:
            _set_or_pop(self._projects, key[1], value)
        elif key[0] == Kind.ACME.value:
            values = self._challenges.setdefault(key[1], {})
            _set_or_pop(values, bytes.fromhex(key[2]), value)
            if not values:
                del self._challenges[key[1]]
        elif key[0] == Kind.FENCE.value:
            _set_or_pop(self._fenced, key[1], value)
        elif key[0] == Kind.IDEM.value:
            _set_or_pop(self._idempotency, key[1], value)
        elif key[0] == Kind.CERT.value:
            _set_or_pop(self._certs, key[2], value)
            if value is None:
                self._cert_keys.pop(key[2], None)
            else:
                self._cert_keys[key[2]] = key
        else:
            _set_or_pop(self._copies, (key[1], key[2]), value)



def _set_or_pop(index: dict[Any, Any], key: Any, value: Value | None) -> None:
    if value is None:
        index.pop(key, None)
    else:
        index[key] = value


def entry_to_json(entry: Entry) -> dict[str, object]:
    from region_agent.state.model import encode_value

    return {
        "v": SCHEMA_VERSION,
        "key": list(entry.key),
        "value": None if entry.value is None else encode_value(entry.value),
        "hlc": entry.version.hlc,
        "writer": entry.version.writer,
        "signer": entry.signer,
        "sig": base64.b64encode(entry.signature).decode(),
    }


def entry_from_json(data: dict[str, object]) -> Entry:
    """Decode an entry received from outside; bad input raises :class:`ModelError`."""
    from region_agent.state.model import decode_value

    version = data.get("v")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ModelError(f"entry schema version {version!r} is not {SCHEMA_VERSION}, the one this agent knows")
    try:
        raw_key = data["key"]
        if not isinstance(raw_key, list):
            raise ModelError("key must be a list")
        key: Key = tuple(str(part) for part in raw_key)
        hlc = data["hlc"]
        writer = data["writer"]
        if not isinstance(hlc, int) or hlc < 0 or not isinstance(writer, str) or not writer:
            raise ModelError("hlc must be a non-negative integer and writer a non-empty string")
        raw_value = data.get("value")
        if raw_value is not None and not isinstance(raw_value, dict):
            raise ModelError("value must be an object or null")
        signer, sig = data.get("signer", ""), data.get("sig", "")
        if not isinstance(signer, str) or len(signer) > 64 or not isinstance(sig, str) or len(sig) > 256:
            raise ModelError("signer and sig must be short strings")
        signature = base64.b64decode(sig, validate=True)
    except KeyError as exc:
        raise ModelError(f"entry lacks {exc.args[0]!r}") from exc
    except binascii.Error as exc:
        raise ModelError(f"sig is not base64: {exc}") from exc
    check_key(key)
    value = None if raw_value is None else decode_value(key, raw_value)
    return Entry(key, value, Version(hlc, writer), signer, signature)


def dumps_entries(entries: Iterable[Entry]) -> bytes:
    return json.dumps([entry_to_json(e) for e in entries], separators=(",", ":")).encode()


def _passes(jobs: list[SignatureJob]) -> list[bool]:
    return [job.passes() for job in jobs]


PARALLEL_VERIFY_MIN = 512   # signature checks below which one thread does them all
LOOP_SIGN_LIMIT = 64   # entries signed on the event loop at most (~2 ms); a larger batch is signed in a thread


async def put_many_off_loop(store: Store, items: Iterable[tuple[Key, Value | None]], *,
                            writer: str | None = None) -> list[Entry]:
    """:meth:`Store.put_many` for a batch that may be large (a zone file import, a first watch sync):
    the signatures are made in a worker thread, so the event loop (which answers DNS) keeps turning."""
    entries = store.prepare(items, writer=writer)
    if store.signer is not None and len(entries) > LOOP_SIGN_LIMIT:
        entries = await asyncio.to_thread(store.sign, entries)
    else:
        entries = store.sign(entries)
    return store.apply_local(entries)
