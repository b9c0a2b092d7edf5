"""Signed member records: a keyring holder without a certificate, or an agent of another region with
one, can not add a member, move one, or speak for another region; suspicion stays refutable."""

from __future__ import annotations

import random

from region_agent.base.identity import CertBook
from region_agent.gossip.config import GossipConfig
from region_agent.gossip.credentials import IdentityCredentials
from region_agent.gossip.membership import Membership
from region_agent.gossip.messages import (
    MAX_UINT32,
    Address,
    Alive,
    Member,
    MemberState,
    Proof,
    PushPull,
    Role,
    State,
    Suspect,
    encode,
)
from region_agent.gossip.scheduler import VirtualScheduler
from tests.fakes.identities import Agent, ClusterCA
from tests.gossip.test_membership import CONFIG, Rig, Wire

CA = ClusterCA.make()
SFO1, SFO2, AMS = CA.agent("sfo1", "n1"), CA.agent("sfo1", "n2"), CA.agent("ams1", "n1")


def _member(region: str, node: str, host: int, incarnation: int = 1, role: Role = Role.AGENT) -> Member:
    return Member(f"{region}/{node}", region, node, role, Address(f"10.0.0.{host}", 7946), (), incarnation)


def _credentials(agent: Agent, book: CertBook) -> IdentityCredentials:
    return IdentityCredentials(book, lambda: agent.signer)


def _signed(member: Member, agent: Agent) -> Proof:
    return _credentials(agent, CA.book()).prove(member)


def signed_rig(config: GossipConfig = CONFIG) -> Rig:
    """sfo1/n1 with credentials, knowing every certificate above (as after a sync of the store)."""
    clock = VirtualScheduler()
    wire = Wire(clock)
    rig = Rig(None, wire, clock)  # type: ignore[arg-type]
    book = CA.book()
    for agent in (SFO1, SFO2, AMS):
        book.add(agent.der)
    node = Membership(config, _member("sfo1", "n1", 1), wire, clock, rng=random.Random(7), events=rig,
                      credentials=_credentials(SFO1, book))
    node.start()
    rig.node, wire.receiver = node, node
    return rig


def test_a_signed_member_joins_and_an_unsigned_or_forged_one_does_not() -> None:
    rig = signed_rig()
    ams = _member("ams1", "n1", 3)
    rig.feed(Alive(ams, _signed(ams, AMS)))
    assert rig.node.member("ams1/n1") is not None
    before = rig.node.live_count()
    # A keyring holder's made-up member of a made-up region, unsigned; then one claiming ams1, signed with
    # the sfo1 key it stole... no: with a valid sfo1 certificate, speaking for ams1.
    fake = _member("xyz9", "evil", 9)
    rig.feed(Alive(fake))
    rig.feed(Alive(_member("ams1", "n7", 7), _signed(_member("ams1", "n7", 7), SFO2)))
    assert rig.node.member("xyz9/evil") is None and rig.node.member("ams1/n7") is None
    assert rig.node.live_count() == before
    assert rig.node.stats.rejected["unsigned"] == 1 and rig.node.stats.rejected["wrong-signer"] == 1


def test_a_forged_record_can_not_move_a_member_or_outbid_it() -> None:
    rig = signed_rig()
    ams = _member("ams1", "n1", 3)
    rig.feed(Alive(ams, _signed(ams, AMS)))
    moved = _member("ams1", "n1", 66, incarnation=2**31)
    rig.feed(Alive(moved, Proof(AMS.identity.fingerprint, _signed(ams, AMS).signature)))   # an old signature
    rig.feed(Alive(moved))
    view = rig.node.member("ams1/n1")
    assert view is not None and view.member == ams
    assert rig.node.stats.rejected["bad-signature"] == 1 and rig.node.stats.rejected["unsigned"] == 1


def test_a_push_pull_carries_the_certificates_a_joiner_needs() -> None:
    """A joining agent knows no certificate but its own: each row brings its member's."""
    clock = VirtualScheduler()
    wire = Wire(clock)
    rig = Rig(None, wire, clock)  # type: ignore[arg-type]
    book = CA.book()
    node = Membership(CONFIG, _member("sfo1", "n1", 1), wire, clock, rng=random.Random(7), events=rig,
                      credentials=_credentials(SFO1, book))
    node.start()
    ams, sfo2 = _member("ams1", "n1", 3), _member("sfo1", "n2", 2)
    rows = (MemberState(ams, State.ALIVE, _signed(ams, AMS), AMS.der),
            MemberState(sfo2, State.ALIVE, _signed(sfo2, SFO2), SFO2.der),
            MemberState(_member("fra1", "n1", 4), State.ALIVE))            # unsigned row: dropped
    node.receive_stream(encode(PushPull(False, True, rows)), ams.addr)
    assert {v.member.name for v in node.members()} == {"sfo1/n1", "ams1/n1", "sfo1/n2"}
    # What it passes on is checkable by the next joiner: every row has its proof and certificate.
    payload = node._push_pull_payload(join=False, reply=False)
    assert payload and all(len(row.cert) > 0 and row.proof for row in _rows(payload))


def _rows(payload: bytes) -> tuple[MemberState, ...]:
    from region_agent.gossip.messages import decode

    message = decode(payload)
    assert isinstance(message, PushPull)
    return message.states


def test_an_accusation_at_the_last_incarnation_is_ignored_and_nothing_raises() -> None:
    """A suspicion of 2**32-1 used to raise inside the packet handler (the refutation overflowed) and
    took the victim out of the answers for the suspicion timeout, once per datagram."""
    rig = signed_rig()
    ams = _member("ams1", "n1", 3)
    rig.feed(Alive(ams, _signed(ams, AMS)))
    rig.feed(Suspect("ams1/n1", MAX_UINT32, "sfo1/n2"))
    rig.feed(Suspect("sfo1/n1", MAX_UINT32, "sfo1/n2"))   # about ourselves
    view = rig.node.member("ams1/n1")
    assert view is not None and view.state is State.ALIVE
    own = rig.node.member("sfo1/n1")
    assert own is not None and own.state is State.ALIVE and own.member.incarnation < MAX_UINT32
    assert rig.node.stats.rejected["future-incarnation"] == 2
    # At the incarnation it announced, it is suspected, and it can refute that.
    rig.feed(Suspect("sfo1/n1", own.member.incarnation, "sfo1/n2"))
    refuted = rig.node.member("sfo1/n1")
    assert refuted is not None and refuted.member.incarnation == own.member.incarnation + 1
