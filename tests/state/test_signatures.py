"""Signed entries: every forgery an insider could send is refused, counted, and changes nothing.

The insiders: a holder of the gossip keyring with no certificate (it can send any datagram, so
any entry, unsigned or signed by a key of its own), and an agent of another region with a valid
certificate (it can sign, but only as itself).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from region_agent.base.identity import ENTRY, Identity, Signer, fingerprint
from region_agent.state.hlc import HybridClock, pack
from region_agent.state.model import (
    Certificate,
    Challenge,
    CopyHealth,
    Fence,
    Project,
    Region,
    cert_key,
    challenge_key,
    copy_key,
    fence_key,
    project_key,
    region_key,
)
from region_agent.state.signatures import EntryVerifier
from region_agent.state.store import Entry, RejectReason, Store, Version, entry_from_json, entry_to_json, signed_bytes
from tests.fakes.identities import Agent, ClusterCA


def _clock() -> HybridClock:
    return HybridClock(lambda: int(time.time() * 1000))


def agent_store(ca: ClusterCA, agent: Agent, node: str) -> Store:
    """An agent's store: signs as the agent, verifies under the CA, holds its own certificate."""
    store = Store(writer=f"{agent.identity.region}/{node}", clock=_clock(), signer=agent.signer,
                  verifier=EntryVerifier(ca.book()))
    cert = Certificate(agent.der)
    store.put(cert_key(agent.identity.region, cert), cert)
    return store


@pytest.fixture
def ca() -> ClusterCA:
    return ClusterCA.make()


@pytest.fixture
def sfo(ca: ClusterCA) -> Agent:
    return ca.agent("sfo1")


@pytest.fixture
def ams(ca: ClusterCA) -> Agent:
    return ca.agent("ams1")


def receiver(ca: ClusterCA, *holders: Store) -> Store:
    """A third agent (nrt1) that has synced with ``holders``: it knows their certificates."""
    store = agent_store(ca, ca.agent("nrt1"), "n1")
    for holder in holders:
        result = store.merge(holder.entries())
        assert result.rejected == []
    return store


def forged(entry: Entry, key: ec.EllipticCurvePrivateKey | None, signer: str) -> Entry:
    """``entry`` re-signed with ``key`` (None: unsigned) under the claimed ``signer`` fingerprint."""
    if key is None:
        return dataclasses.replace(entry, signer="", signature=b"")
    own = Signer(key, Identity(signer, "xxx0", None, 0, 0, b"", key.public_key()))
    return dataclasses.replace(entry, signer=signer,
                               signature=own.sign(ENTRY, signed_bytes(entry.key, entry.version, entry.value)))


def refused(store: Store, entry: Entry) -> RejectReason:
    digest = store.digest()
    before = dict(store.projects), dict(store.copies), dict(store.fenced), dict(store.challenges)
    result = store.merge([entry])
    assert result.applied == [] and len(result.rejected) == 1
    assert store.digest() == digest
    assert (dict(store.projects), dict(store.copies), dict(store.fenced), dict(store.challenges)) == before
    reason = result.rejected[0].reason
    assert store.metrics.rejected.labels(reason.value)._value.get() >= 1
    return reason


def test_a_signed_entry_verifies_anywhere_and_its_certificate_travels_with_the_store(ca: ClusterCA, sfo: Agent) -> None:
    a = agent_store(ca, sfo, "n1")
    a.put_many([(project_key("shop"), Project("shop", ("sfo1",)))], writer="control/sfo1.n1")
    a.put(copy_key("shop", "sfo1"), CopyHealth(True))
    b = receiver(ca, a)
    assert "shop" in b.projects and b.copies[("shop", "sfo1")].healthy
    # A third agent learns it from b alone (relayed, never talking to a): the certificate entry came along.
    c = receiver(ca, b)
    assert "shop" in c.projects and c.copies[("shop", "sfo1")].healthy
    entry = c.entry(project_key("shop"))
    assert entry is not None and entry.signer == sfo.identity.fingerprint
    assert entry_from_json(entry_to_json(entry)) == entry   # the signature survives the wire


def test_the_keyring_holder_without_a_certificate_forges_nothing(ca: ClusterCA, sfo: Agent) -> None:
    victim = agent_store(ca, sfo, "n1")
    store = receiver(ca, victim)
    attacker = ec.generate_private_key(ec.SECP256R1())
    now = store.clock.now() + 1
    forgeries = {
        "a project's primary": Entry(project_key("shop"), Project("shop", ("ams1", "sfo1"), primary="ams1"),
                                     Version(now, "control/sfo1.n1")),
        "an ACME TXT": Entry(challenge_key("_acme-challenge.www.g.example.com.", b"\x05token"),
                             Challenge("_acme-challenge.www.g.example.com.", b"\x05token", 60, 2**31 - 1),
                             Version(now, "acme/sfo1.n1")),
        "another region's copy": Entry(copy_key("shop", "sfo1"), CopyHealth(False, "forged"), Version(now, "sfo1/n1")),
        "a fence": Entry(fence_key("sfo1"), Fence("sfo1", "forged"), Version(now, "control/sfo1.n1")),
    }
    for what, entry in forgeries.items():
        assert refused(store, forged(entry, None, "")) is RejectReason.UNSIGNED, what
        # Signed with a key of its own, claiming the victim's fingerprint: the signature fails.
        assert refused(store, forged(entry, attacker, sfo.identity.fingerprint)) is RejectReason.BAD_SIGNATURE, what
        # Or under a fingerprint nobody knows.
        assert refused(store, forged(entry, attacker, "f" * 32)) is RejectReason.UNKNOWN_SIGNER, what


def test_a_self_made_certificate_is_no_identity(ca: ClusterCA) -> None:
    store = receiver(ca)
    rogue_ca = ClusterCA.make("rogue CA")
    rogue = rogue_ca.agent("sfo1")
    cert = Certificate(rogue.der)
    own = Store(writer="sfo1/n9", clock=_clock(), signer=rogue.signer)
    entry = own.put(cert_key("sfo1", cert), cert)
    assert entry is not None
    assert refused(store, entry) is RejectReason.BAD_SIGNER
    copy = own.put(copy_key("shop", "sfo1"), CopyHealth(False, "forged"))
    assert copy is not None and refused(store, copy) is RejectReason.UNKNOWN_SIGNER


def test_an_agent_of_another_region_signs_only_as_itself(ca: ClusterCA, sfo: Agent, ams: Agent) -> None:
    amsterdam = agent_store(ca, ams, "n1")
    store = receiver(ca, amsterdam)
    clock = store.clock.now() + 1

    def signed_by_ams(key: tuple[str, ...], value: object, writer: str) -> Entry:
        entry = Entry(key, value, Version(clock, writer))  # type: ignore[arg-type]
        return forged(entry, ams.key, ams.identity.fingerprint)

    # San Francisco's copy, claimed as San Francisco's writer: the certificate names ams1.
    assert refused(store, signed_by_ams(copy_key("shop", "sfo1"), CopyHealth(False), "sfo1/n1")) is \
        RejectReason.BAD_SIGNER
    # As its own writer: it does not own the key.
    assert refused(store, signed_by_ams(copy_key("shop", "sfo1"), CopyHealth(False), "ams1/n1")) is \
        RejectReason.NOT_OWNER
    # A control write claimed for an agent of sfo1: refused; in its own name it is a control write (any agent
    # takes those), and says who made it.
    assert refused(store, signed_by_ams(fence_key("sfo1"), Fence("sfo1"), "control/sfo1.n1")) is \
        RejectReason.BAD_SIGNER
    own = signed_by_ams(fence_key("sfo1"), Fence("sfo1", "maintenance"), "control/ams1.n1")
    assert store.merge([own]).applied == [own]
    # Its certificate under another region's name.
    cert = Certificate(ams.der)
    filed = Entry(cert_key("sfo1", cert), cert, Version(clock, "sfo1/n1"))
    assert refused(store, forged(filed, ams.key, ams.identity.fingerprint)) in (RejectReason.BAD_SIGNER,)


def test_a_tampered_value_does_not_verify(ca: ClusterCA, sfo: Agent) -> None:
    a = agent_store(ca, sfo, "n1")
    entry = a.put(copy_key("shop", "sfo1"), CopyHealth(True))
    assert entry is not None
    store = receiver(ca)
    cert = a.entry(cert_key("sfo1", Certificate(sfo.der)))
    assert cert is not None and store.merge([cert]).rejected == []
    assert refused(store, dataclasses.replace(entry, value=CopyHealth(False, "tampered"))) is \
        RejectReason.BAD_SIGNATURE
    later = dataclasses.replace(entry, version=Version(entry.version.hlc + 1, entry.version.writer))
    assert refused(store, later) is RejectReason.BAD_SIGNATURE


def test_a_revoked_certificate_signs_nothing_more(ca: ClusterCA, sfo: Agent) -> None:
    a = agent_store(ca, sfo, "n1")
    store = receiver(ca, a)
    verifier = store.verifier
    assert isinstance(verifier, EntryVerifier)
    verifier.book.set_revoked([fingerprint(sfo.der)])
    entry = a.put(copy_key("shop", "sfo1"), CopyHealth(False))
    assert entry is not None and refused(store, entry) is RejectReason.REVOKED


def test_an_expired_certificate_keeps_what_it_signed_while_valid(ca: ClusterCA) -> None:
    old = ca.expired_agent("sfo1")
    store = receiver(ca)
    verifier = store.verifier
    assert isinstance(verifier, EntryVerifier)
    # Learned while it was valid (e.g. from a snapshot of a week ago): what it signed then still verifies.
    verifier.book._known[old.identity.fingerprint] = old.identity
    then = pack(int(old.identity.not_before * 1000) + 60_000)
    within = forged(Entry(copy_key("shop", "sfo1"), CopyHealth(True), Version(then, "sfo1/n1")), old.key,
                    old.identity.fingerprint)
    assert store.merge([within]).applied == [within]
    # Signed "now" with the old key: outside the validity, whatever the HLC says.
    now = forged(Entry(copy_key("shop", "sfo1"), CopyHealth(False), Version(store.clock.now(), "sfo1/n1")),
                 old.key, old.identity.fingerprint)
    assert refused(store, now) is RejectReason.BAD_SIGNER


def test_verification_is_skipped_for_what_is_already_held(ca: ClusterCA, sfo: Agent) -> None:
    a = agent_store(ca, sfo, "n1")
    store = receiver(ca, a)
    calls = 0
    verifier = store.verifier
    assert verifier is not None

    def counting(entry: Entry) -> object:
        nonlocal calls
        calls += 1
        return verifier(entry)

    store.verifier = counting  # type: ignore[assignment]
    result = store.merge(a.entries())
    assert calls == 0 and result.stale == len(list(a.entries())) and result.applied == []


def test_one_version_two_values_converge_and_the_digest_sees_the_value() -> None:
    """Only the writer can make two values at one version (a bug, or a store restored twice); every store keeps
    the same one, whatever the order, and the digest tells them apart."""
    version = Version(pack(1_000), "control/sfo1.n1")
    one = Entry(region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",)), version)
    two = Entry(region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.2",)), version)
    stores = []
    for order in ([one, two], [two, one]):
        store = Store(writer="sfo1/x", clock=HybridClock(lambda: 2_000))
        for entry in order:
            store.merge([entry])
        stores.append(store)
    assert stores[0].entry(region_key("sfo1")) == stores[1].entry(region_key("sfo1"))
    assert stores[0].digest() == stores[1].digest()
    alone = Store(writer="sfo1/x", clock=HybridClock(lambda: 2_000))
    loser = one if stores[0].entry(region_key("sfo1")) == two else two
    alone.merge([loser])
    assert alone.digest() != stores[0].digest()
