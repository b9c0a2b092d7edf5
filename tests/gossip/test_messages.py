"""Wire format: every message round-trips, and malformed input only ever raises MessageError."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from region_agent.gossip.messages import (
    MAX_USER_PAYLOAD,
    VERSION,
    Ack,
    Address,
    Alive,
    Compound,
    Dead,
    Member,
    MemberState,
    Message,
    MessageError,
    Nack,
    Ping,
    PingReq,
    PushPull,
    Role,
    State,
    Suspect,
    User,
    decode,
    decode_parts,
    encode,
)

ADDR = Address("10.0.0.1", 7946)
MEMBER = Member("sfo1/node-a", "sfo1", "node-a", Role.AGENT, ADDR, Member.meta_from({"zone": "b", "ip6": "::1"}), 7)
WITNESS = Member("ams1/w", "ams1", "w", Role.WITNESS, Address("2001:db8::1", 1), (), 0)

SAMPLES: list[Message] = [
    Ping(1, "sfo1/node-a", "sfo1/node-b"),
    PingReq(0xFFFF_FFFF, "sfo1/node-a", ADDR, "sfo1/node-c", nack=True),
    Ack(3),
    Nack(4),
    Suspect("sfo1/node-a", 9, "sfo1/node-b"),
    Alive(MEMBER),
    Alive(WITNESS),
    Dead("sfo1/node-a", 9, "sfo1/node-a"),
    User("event-1", "sfo1/node-a", b"\x00payload"),
    Compound((encode(Ack(1)), encode(Alive(MEMBER)))),
    PushPull(join=True, reply=False, states=(MemberState(MEMBER, State.SUSPECT), MemberState(WITNESS, State.LEFT))),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message) -> None:
    data = encode(message)
    assert data[0] == VERSION
    assert decode(data) == message


def test_compact() -> None:
    assert len(encode(Ping(1, "sfo1/node-a", "sfo1/node-b"))) == 2 + 4 + 12 + 12
    assert len(encode(Alive(MEMBER))) < 80


def test_dead_from_itself_is_a_leave() -> None:
    assert Dead("sfo1/a", 1, "sfo1/a").is_leave
    assert not Dead("sfo1/a", 1, "sfo1/b").is_leave


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "truncated"),
    (bytes([VERSION]), "truncated"),
    (bytes([1, 2, 0, 0, 0, 1]), "unsupported protocol version 1"),   # before signed members
    (bytes([3, 2, 0, 0, 0, 1]), "unsupported protocol version 3"),
    (bytes([VERSION, 200]), "unknown message type"),
    (encode(Ack(1)) + b"x", "trailing bytes"),
    (encode(Ack(1))[:-1], "truncated"),
    (bytes([VERSION, 0]) + struct.pack(">I", 1) + b"\x03a\xffb" + b"\x01b", "invalid UTF-8"),
    (bytes([VERSION, 0]) + struct.pack(">I", 1) + b"\x00" + b"\x01b", "bad target"),
    (bytes([VERSION, 7, 0]), "bad compound size"),
    (bytes([VERSION, 1]) + encode(PingReq(1, "a", ADDR, "b", nack=True))[2:-1] + b"\x02", "bad flag"),
])
def test_malformed_refused(data: bytes, reason: str) -> None:
    with pytest.raises(MessageError, match=reason):
        decode(data)


def test_compound_may_not_nest() -> None:
    inner = encode(Compound((encode(Ack(1)),)))
    with pytest.raises(MessageError, match="nested"):
        decode_parts(Compound((encode(Ack(2)), inner)))


@pytest.mark.parametrize("build", [
    lambda: Member("sfo1/a", "SFO1", "a", Role.AGENT, ADDR),                       # region pattern
    lambda: Member("sfo1/a", "sfo1", "a b", Role.AGENT, ADDR),                     # node pattern
    lambda: Member("sfo1/a", "sfo1", "a", "agent", ADDR),  # type: ignore[arg-type]  # role not a Role
    lambda: Member("sfo1/a", "sfo1", "a", Role.AGENT, ADDR, (("b", "1"), ("a", "2"))),  # unsorted meta
    lambda: Member("sfo1/a", "sfo1", "a", Role.AGENT, ADDR, (("k", "x" * 600),)),     # meta too big
    lambda: Member("sfo1/a", "sfo1", "a", Role.AGENT, ADDR, (("k", "\ud800"),)),      # unencodable
    lambda: Member("sfo1/a", "sfo1", "a", Role.AGENT, ADDR, incarnation=-1),
    lambda: Member("sfo1/a", "sfo1", "a", Role.AGENT, ADDR, incarnation=2**32),
    lambda: Address("10.0.0.1", 0),
    lambda: Address("bad host", 1),
    lambda: Address("::zz", 1),
    lambda: Ping(True, "a", "b"),
    lambda: User("k", "sfo1/a", b"x" * (MAX_USER_PAYLOAD + 1)),
    lambda: PushPull(False, False, (MemberState(MEMBER, State.ALIVE), MemberState(MEMBER, State.DEAD))),
])
def test_invalid_values_refused_at_construction(build: Callable[[], object]) -> None:
    with pytest.raises(MessageError):
        build()


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    with contextlib.suppress(MessageError):
        decode(data)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_mutated_messages(message: Message, data: st.DataObject) -> None:
    raw = bytearray(encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(raw) - 1))
        raw[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        decoded = decode(bytes(raw[:cut]))
    except MessageError:
        return
    # Whatever decodes is a valid message that encodes back to the same bytes.
    assert encode(decoded) == bytes(raw[:cut])
    if isinstance(decoded, Compound):
        with contextlib.suppress(MessageError):
            decode_parts(decoded)
