"""Gossip messages and their wire format: compact, versioned, bounded, strictly validated.

Every encoded message starts with two bytes: the protocol version and the message type. Integers
are big-endian; strings are UTF-8 with a length prefix (``str8``: one byte, ``str16``: two bytes).
Every value is checked when a message is built, so a decoded message is as valid as one built
here, and :func:`decode` raises :class:`MessageError` and nothing else on any input.

Version history (WARNING: only append message types; the numbers are part of the protocol):
  1 — ping, ping-req, ack, nack, suspect, alive, dead (a dead from the node itself is a leave),
      compound, push-pull, user.
  — sync (10): anti-entropy of the replicated store over streams (appended; an older agent
      counts it as malformed and the round simply does not happen).
  2 — an ack carries the acking member's wall clock (clock offsets between agents); an alive
      carries its member's proof (the signer's certificate fingerprint and a signature
      over the member record, :func:`member_bytes`); a push-pull row carries the proof and the
      member's identity certificate (DER), so a joining agent can check every member it is told of.
"""

from __future__ import annotations

import ipaddress
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Final

VERSION: Final = 2

MAX_NAME = 160
MAX_NODE = 128
MAX_REGION = 32
MAX_HOST = 253
MAX_META_ENTRIES = 16
MAX_META_BYTES = 512          # keys + values of one member, so an alive always fits a datagram
MAX_USER_KEY = 128
MAX_USER_PAYLOAD = 1024
MAX_COMPOUND_PARTS = 64
MAX_MEMBERS = 100_000
MAX_SYNC_BUCKETS = 4096
MAX_SYNC_ENTRIES = 1_000_000
DIGEST_BYTES = 16
MAX_MESSAGE_BYTES = 16 * 1024 * 1024   # a push-pull of MAX_MEMBERS small records stays below it
MAX_UINT32 = 0xFFFF_FFFF
MAX_SIGNER = 64
MAX_SIGNATURE = 160
MAX_CERT = 8 * 1024

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_REGION_RE = re.compile(r"[a-z]{3}[0-9]+")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")
_META_KEY_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


class MessageError(ValueError):
    """A malformed, oversized or unsupported message (the only error :func:`decode` raises)."""


class MessageType(IntEnum):
    PING = 0
    PING_REQ = 1
    ACK = 2
    NACK = 3
    SUSPECT = 4
    ALIVE = 5
    DEAD = 6
    COMPOUND = 7
    PUSH_PULL = 8
    USER = 9
    SYNC = 10


class Role(StrEnum):
    AGENT = "agent"
    WITNESS = "witness"


class State(IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


_ROLES: Final = tuple(Role)
_STATES: Final = tuple(State)


def _typed(value: object, kind: type | tuple[type, ...]) -> bool:
    """isinstance on purpose: constructors also receive values from untyped code."""
    return isinstance(value, kind)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise MessageError(what)


def _check_text(value: object, what: str, pattern: re.Pattern[str], limit: int) -> None:
    _check(isinstance(value, str) and pattern.fullmatch(value) is not None and len(value) <= limit,
           f"bad {what}: {value!r:.80}")


def _check_u32(value: object, what: str) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_UINT32, f"bad {what}")


def _check_host(host: object) -> None:
    if isinstance(host, str) and ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise MessageError(f"bad host: {host!r:.80}") from None
        return
    _check_text(host, "host", _HOST_RE, MAX_HOST)


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __post_init__(self) -> None:
        _check_host(self.host)
        _check(_typed(self.port, int) and not _typed(self.port, bool) and 0 < self.port < 65536,
               f"bad port: {self.port!r}")

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Member:
    """What a member says about itself; ``incarnation`` only it may raise (to refute a suspicion)."""

    name: str
    region: str
    node: str
    role: Role
    addr: Address
    meta: tuple[tuple[str, str], ...] = ()
    incarnation: int = 0

    def __post_init__(self) -> None:
        _check_text(self.name, "member name", _NAME_RE, MAX_NAME)
        _check_text(self.region, "region", _REGION_RE, MAX_REGION)
        _check_text(self.node, "node", _NODE_RE, MAX_NODE)
        _check(_typed(self.role, Role), f"bad role: {self.role!r}")
        _check(_typed(self.addr, Address), "bad address")
        _check_u32(self.incarnation, "incarnation")
        _check(_typed(self.meta, tuple) and len(self.meta) <= MAX_META_ENTRIES, "too many metadata entries")
        size = 0
        previous = ""
        for entry in self.meta:
            _check(_typed(entry, tuple) and len(entry) == 2, "bad metadata entry")
            key, value = entry
            _check_text(key, "metadata key", _META_KEY_RE, 64)
            _check(key > previous, "metadata keys must be sorted and unique")
            _check(_typed(value, str), "bad metadata value")
            previous = key
            try:
                size += len(key) + len(value.encode())
            except UnicodeEncodeError:
                raise MessageError("bad metadata value") from None
        _check(size <= MAX_META_BYTES, "metadata too large")

    @staticmethod
    def meta_from(mapping: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(mapping.items()))

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.meta)


@dataclass(frozen=True, slots=True)
class Proof:
    """Who signed a member record: a certificate fingerprint and the signature (empty: unsigned)."""

    signer: str = ""
    signature: bytes = b""

    def __post_init__(self) -> None:
        _check(_typed(self.signer, str) and len(self.signer) <= MAX_SIGNER and self.signer.isascii(), "bad signer")
        _check(_typed(self.signature, bytes) and len(self.signature) <= MAX_SIGNATURE, "bad signature")

    def __bool__(self) -> bool:
        return bool(self.signature)


NO_PROOF: Final = Proof()


@dataclass(frozen=True, slots=True)
class MemberState:
    """One row of a push-pull: a member, what the sender believes of it, its proof and certificate."""

    member: Member
    state: State
    proof: Proof = NO_PROOF
    cert: bytes = b""   # the member's identity certificate (DER), so the receiver can check the proof

    def __post_init__(self) -> None:
        _check(_typed(self.member, Member) and _typed(self.state, State), "bad member state")
        _check(_typed(self.proof, Proof), "bad proof")
        _check(_typed(self.cert, bytes) and len(self.cert) <= MAX_CERT, "bad certificate")


@dataclass(frozen=True, slots=True)
class Ping:
    seq: int
    target: str      # so a ping that reaches the wrong node (address reuse) is not acked
    source: str

    def __post_init__(self) -> None:
        _check_u32(self.seq, "seq")
        _check_text(self.target, "target", _NAME_RE, MAX_NAME)
        _check_text(self.source, "source", _NAME_RE, MAX_NAME)


@dataclass(frozen=True, slots=True)
class PingReq:
    seq: int
    target: str
    target_addr: Address
    source: str
    nack: bool       # the requester wants a nack if the target does not answer (Lifeguard)

    def __post_init__(self) -> None:
        _check_u32(self.seq, "seq")
        _check_text(self.target, "target", _NAME_RE, MAX_NAME)
        _check(_typed(self.target_addr, Address), "bad target address")
        _check_text(self.source, "source", _NAME_RE, MAX_NAME)
        _check(_typed(self.nack, bool), "bad nack flag")


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int
    wall_ms: int = 0   # the acking member's wall clock when it acked (0: not told), for clock offsets

    def __post_init__(self) -> None:
        _check_u32(self.seq, "seq")
        _check(_typed(self.wall_ms, int) and not _typed(self.wall_ms, bool) and 0 <= self.wall_ms < 1 << 63,
               "bad ack time")


@dataclass(frozen=True, slots=True)
class Nack:
    seq: int

    def __post_init__(self) -> None:
        _check_u32(self.seq, "seq")


@dataclass(frozen=True, slots=True)
class Suspect:
    node: str
    incarnation: int
    source: str

    def __post_init__(self) -> None:
        _check_text(self.node, "node", _NAME_RE, MAX_NAME)
        _check_u32(self.incarnation, "incarnation")
        _check_text(self.source, "source", _NAME_RE, MAX_NAME)


@dataclass(frozen=True, slots=True)
class Alive:
    member: Member
    proof: Proof = NO_PROOF

    def __post_init__(self) -> None:
        _check(_typed(self.member, Member), "bad member")
        _check(_typed(self.proof, Proof), "bad proof")


@dataclass(frozen=True, slots=True)
class Dead:
    """``source == node`` means the node left gracefully."""

    node: str
    incarnation: int
    source: str

    def __post_init__(self) -> None:
        _check_text(self.node, "node", _NAME_RE, MAX_NAME)
        _check_u32(self.incarnation, "incarnation")
        _check_text(self.source, "source", _NAME_RE, MAX_NAME)

    @property
    def is_leave(self) -> bool:
        return self.source == self.node


@dataclass(frozen=True, slots=True)
class User:
    """An opaque application broadcast (store updates later); ``key`` identifies it for dedup."""

    key: str
    origin: str
    payload: bytes

    def __post_init__(self) -> None:
        _check(_typed(self.key, str) and 0 < len(self.key.encode()) <= MAX_USER_KEY, "bad user key")
        _check_text(self.origin, "origin", _NAME_RE, MAX_NAME)
        _check(_typed(self.payload, bytes) and len(self.payload) <= MAX_USER_PAYLOAD, "bad user payload")


@dataclass(frozen=True, slots=True)
class PushPull:
    join: bool
    reply: bool
    states: tuple[MemberState, ...]

    def __post_init__(self) -> None:
        _check(_typed(self.join, bool) and _typed(self.reply, bool), "bad push-pull flags")
        _check(_typed(self.states, tuple) and len(self.states) <= MAX_MEMBERS, "bad push-pull states")
        _check(all(_typed(s, MemberState) for s in self.states), "bad push-pull state")
        _check(len({s.member.name for s in self.states}) == len(self.states), "a member twice in a push-pull")


class SyncPhase(IntEnum):
    """The steps of one anti-entropy round (see :mod:`region_agent.gossip.sync`)."""

    OFFER = 0     # initiator → peer: my whole digest
    DIGESTS = 1   # peer → initiator: they differ, here are my bucket digests
    ENTRIES = 2   # initiator → peer: my entries of the differing buckets, and my digests of them
    FINAL = 3     # peer → initiator: my entries of the buckets where you still lack something


_PHASES: Final = tuple(SyncPhase)


@dataclass(frozen=True, slots=True)
class Sync:
    """One anti-entropy step: opaque digests and entries; the store behind a delegate reads them."""

    phase: SyncPhase
    round: int
    origin: str
    digest: bytes = b""
    buckets: tuple[tuple[int, bytes], ...] = ()
    entries: tuple[bytes, ...] = ()
    more: bool = False

    def __post_init__(self) -> None:
        _check(_typed(self.phase, SyncPhase), f"bad sync phase: {self.phase!r}")
        _check_u32(self.round, "sync round")
        _check_text(self.origin, "origin", _NAME_RE, MAX_NAME)
        _check(_typed(self.digest, bytes) and len(self.digest) in (0, DIGEST_BYTES), "bad sync digest")
        _check(_typed(self.buckets, tuple) and len(self.buckets) <= MAX_SYNC_BUCKETS, "too many sync buckets")
        for row in self.buckets:
            ok = _typed(row, tuple) and len(row) == 2  # runtime check: rows may come from untyped code
            ok = ok and _typed(row[0], int) and not _typed(row[0], bool) and 0 <= row[0] < MAX_SYNC_BUCKETS
            _check(ok and _typed(row[1], bytes) and len(row[1]) == DIGEST_BYTES, "bad sync bucket")
        _check(_typed(self.entries, tuple) and len(self.entries) <= MAX_SYNC_ENTRIES, "too many sync entries")
        _check(all(_typed(e, bytes) and 0 < len(e) <= 0xFFFF for e in self.entries), "bad sync entry")
        _check(_typed(self.more, bool), "bad sync flag")


Single = Ping | PingReq | Ack | Nack | Suspect | Alive | Dead | User


@dataclass(frozen=True, slots=True)
class Compound:
    """Several encoded single messages in one datagram (piggybacked broadcasts)."""

    parts: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _check(_typed(self.parts, tuple) and 0 < len(self.parts) <= MAX_COMPOUND_PARTS, "bad compound size")
        _check(all(_typed(p, bytes) and 2 <= len(p) <= 0xFFFF for p in self.parts), "bad compound part")


Message = Single | Compound | PushPull | Sync

_TYPES: Final[dict[type, MessageType]] = {
    Ping: MessageType.PING, PingReq: MessageType.PING_REQ, Ack: MessageType.ACK, Nack: MessageType.NACK,
    Suspect: MessageType.SUSPECT, Alive: MessageType.ALIVE, Dead: MessageType.DEAD,
    Compound: MessageType.COMPOUND, PushPull: MessageType.PUSH_PULL, User: MessageType.USER,
    Sync: MessageType.SYNC,
}


def message_type(message: Message) -> MessageType:
    return _TYPES[type(message)]


# --- encoding -------------------------------------------------------------------------------------


class _Writer:
    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def u8(self, value: int) -> None:
        self.buf.append(value)

    def u16(self, value: int) -> None:
        self.buf += struct.pack(">H", value)

    def u32(self, value: int) -> None:
        self.buf += struct.pack(">I", value)

    def str8(self, value: str) -> None:
        raw = value.encode()
        self.buf.append(len(raw))
        self.buf += raw

    def bytes16(self, raw: bytes) -> None:
        self.buf += struct.pack(">H", len(raw))
        self.buf += raw

    def address(self, addr: Address) -> None:
        self.str8(addr.host)
        self.u16(addr.port)

    def member(self, m: Member) -> None:
        self.str8(m.name)
        self.str8(m.region)
        self.str8(m.node)
        self.u8(_ROLES.index(m.role))
        self.address(m.addr)
        self.u8(len(m.meta))
        for key, value in m.meta:
            self.str8(key)
            self.bytes16(value.encode())
        self.u32(m.incarnation)

    def proof(self, proof: Proof) -> None:
        self.str8(proof.signer)
        self.u8(len(proof.signature))
        self.buf += proof.signature


def member_bytes(member: Member) -> bytes:
    """The bytes a member's proof signs: its record as encoded on the wire."""
    w = _Writer()
    w.member(member)
    return bytes(w.buf)


def encode(message: Message) -> bytes:
    w = _Writer()
    w.u8(VERSION)
    w.u8(_TYPES[type(message)])
    match message:
        case Ping(seq, target, source):
            w.u32(seq)
            w.str8(target)
            w.str8(source)
        case PingReq(seq, target, target_addr, source, nack):
            w.u32(seq)
            w.str8(target)
            w.address(target_addr)
            w.str8(source)
            w.u8(int(nack))
        case Ack(seq, wall_ms):
            w.u32(seq)
            w.buf += struct.pack(">Q", wall_ms)
        case Nack(seq):
            w.u32(seq)
        case Suspect(node, incarnation, source) | Dead(node, incarnation, source):
            w.str8(node)
            w.u32(incarnation)
            w.str8(source)
        case Alive(member, proof):
            w.member(member)
            w.proof(proof)
        case User(key, origin, payload):
            w.str8(key)
            w.str8(origin)
            w.bytes16(payload)
        case Compound(parts):
            w.u8(len(parts))
            for part in parts:
                w.bytes16(part)
        case PushPull(join, reply, states):
            w.u8(int(join) | int(reply) << 1)
            w.u32(len(states))
            for row in states:
                w.member(row.member)
                w.u8(row.state)
                w.proof(row.proof)
                w.bytes16(row.cert)
        case Sync(phase, round_, origin, digest, buckets, entries, more):
            w.u8(phase)
            w.u32(round_)
            w.str8(origin)
            w.u8(int(more))
            w.bytes16(digest)
            w.u16(len(buckets))
            for bucket, bucket_digest in buckets:
                w.u16(bucket)
                w.buf += bucket_digest
            w.u32(len(entries))
            for entry in entries:
                w.bytes16(entry)
    return bytes(w.buf)


# --- decoding -------------------------------------------------------------------------------------


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise MessageError("truncated message")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        value: int = struct.unpack(">H", self.take(2))[0]
        return value

    def u32(self) -> int:
        value: int = struct.unpack(">I", self.take(4))[0]
        return value

    def text(self, n: int) -> str:
        try:
            return self.take(n).decode()
        except UnicodeDecodeError:
            raise MessageError("invalid UTF-8") from None

    def str8(self) -> str:
        return self.text(self.u8())

    def bytes16(self) -> bytes:
        return self.take(self.u16())

    def flag(self) -> bool:
        value = self.u8()
        _check(value in (0, 1), "bad flag")
        return bool(value)

    def address(self) -> Address:
        return Address(self.str8(), self.u16())

    def member(self) -> Member:
        name, region, node = self.str8(), self.str8(), self.str8()
        role = self.u8()
        _check(role < len(_ROLES), "unknown role")
        addr = self.address()
        count = self.u8()
        _check(count <= MAX_META_ENTRIES, "too many metadata entries")
        meta = tuple((self.str8(), self.text(self.u16())) for _ in range(count))
        return Member(name, region, node, _ROLES[role], addr, meta, self.u32())

    def proof(self) -> Proof:
        return Proof(self.str8(), self.take(self.u8()))

    def done(self) -> None:
        _check(self.pos == len(self.data), "trailing bytes")


def decode(data: bytes) -> Message:
    """Decode one message; raises :class:`MessageError` for anything malformed."""
    if not _typed(data, (bytes, bytearray, memoryview)):
        raise MessageError("not bytes")
    data = bytes(data)
    _check(len(data) <= MAX_MESSAGE_BYTES, "message too large")
    r = _Reader(data)
    version = r.u8()
    _check(version == VERSION, f"unsupported protocol version {version}")
    kind = r.u8()
    message: Message
    if kind == MessageType.PING:
        message = Ping(r.u32(), r.str8(), r.str8())
    elif kind == MessageType.PING_REQ:
        message = PingReq(r.u32(), r.str8(), r.address(), r.str8(), r.flag())
    elif kind == MessageType.ACK:
        message = Ack(r.u32(), struct.unpack(">Q", r.take(8))[0])
    elif kind == MessageType.NACK:
        message = Nack(r.u32())
    elif kind == MessageType.SUSPECT:
        message = Suspect(r.str8(), r.u32(), r.str8())
    elif kind == MessageType.ALIVE:
        message = Alive(r.member(), r.proof())
    elif kind == MessageType.DEAD:
        message = Dead(r.str8(), r.u32(), r.str8())
    elif kind == MessageType.USER:
        message = User(r.str8(), r.str8(), r.bytes16())
    elif kind == MessageType.COMPOUND:
        count = r.u8()
        _check(0 < count <= MAX_COMPOUND_PARTS, "bad compound size")
        message = Compound(tuple(r.bytes16() for _ in range(count)))
    elif kind == MessageType.PUSH_PULL:
        flags = r.u8()
        _check(flags < 4, "bad push-pull flags")
        count = r.u32()
        _check(count <= MAX_MEMBERS, "too many members")
        states = []
        for _ in range(count):
            member = r.member()
            state = r.u8()
            _check(state < len(_STATES), "unknown member state")
            states.append(MemberState(member, _STATES[state], r.proof(), r.bytes16()))
        message = PushPull(bool(flags & 1), bool(flags & 2), tuple(states))
    elif kind == MessageType.SYNC:
        phase = r.u8()
        _check(phase < len(_PHASES), "unknown sync phase")
        round_, origin, more, digest = r.u32(), r.str8(), r.flag(), r.bytes16()
        count = r.u16()
        _check(count <= MAX_SYNC_BUCKETS, "too many sync buckets")
        buckets = tuple((r.u16(), r.take(DIGEST_BYTES)) for _ in range(count))
        count = r.u32()
        _check(count <= MAX_SYNC_ENTRIES, "too many sync entries")
        entries = tuple(r.bytes16() for _ in range(count))
        message = Sync(_PHASES[phase], round_, origin, digest, buckets, entries, more)
    else:
        raise MessageError(f"unknown message type {kind}")
    r.done()
    return message


def decode_parts(compound: Compound) -> list[Single]:
    """The single messages inside a compound, all or none; a nested compound or push-pull is malformed."""
    parts: list[Single] = []
    for part in compound.parts:
        message = decode(part)
        if isinstance(message, Compound | PushPull | Sync):
            raise MessageError("nested compound, push-pull or sync in a compound")
        parts.append(message)
    return parts
