"""Checking a store entry's signature: is it what the agent its writer id names actually wrote?

A signed entry names its signer by certificate fingerprint. :class:`EntryVerifier` refuses it
unless, in this order:

1. it is signed at all (``unsigned``; only a lab cluster, ``gossip.allow_unsigned``, takes
   unsigned entries, and then only unsigned ones are not checked);
2. the signer's certificate is trusted: a certificate entry brings its own certificate, checked
   against the cluster CA as it arrives; any other entry's signer must already be known, from a
   certificate entry of the store (``unknown-signer`` otherwise: anti-entropy brings it, and the
   replica retries) and not revoked (``revoked``);
3. the writer id names an agent (``<region>/<node>``, ``control/<region>.<node>``,
   ``acme/<region>.<node>``) that the certificate covers: its region, and its node when it names
   one (``bad-signer``). With the owner rules of :mod:`region_agent.state.model` this is the
   NodeRestriction of the store: a region's keys verify only with a certificate of that region,
   while ``control`` and ``acme`` entries verify with any agent's certificate but say which;
4. the certificate was valid at the entry's HLC time (``bad-signer``), so a certificate that
   expired keeps what it signed while valid, and a key leaked after expiry signs nothing new;
5. the signature verifies over :func:`~region_agent.state.store.signed_bytes` (``bad-signature``).
"""

from __future__ import annotations

from dataclasses import dataclass

from region_agent.base.identity import ENTRY, CertBook, Identity, IdentityError
from region_agent.state.hlc import physical_ms
from region_agent.state.model import Certificate, Kind, writer_agent
from region_agent.state.store import Entry, Rejected, RejectReason, signed_bytes

VALIDITY_SLACK_SECONDS = 300.0   # clocks of writer and CA differ a little: the CA backdates by 5 minutes too


@dataclass(frozen=True, slots=True)
class SignatureCheck:
    """The one expensive step of a verification, split off so a batch can run it on several cores."""

    entry: Entry
    identity: Identity
    data: bytes

    def passes(self) -> bool:
        return self.identity.verify(ENTRY, self.data, self.entry.signature)

    def refusal(self) -> Rejected:
        return Rejected(self.entry, RejectReason.BAD_SIGNATURE,
                        f"{self.entry.key!r} by {self.entry.version.writer}: the signature does not verify")


class EntryVerifier:
    def __init__(self, book: CertBook, *, allow_unsigned: bool = False) -> None:
        self.book = book
        self.allow_unsigned = allow_unsigned

    def __call__(self, entry: Entry) -> Rejected | None:
        outcome = self.prepare(entry)
        if isinstance(outcome, SignatureCheck):
            return None if outcome.passes() else outcome.refusal()
        return outcome

    def prepare(self, entry: Entry) -> Rejected | SignatureCheck | None:
        """Every check but the signature itself: a refusal, the signature check left to do, or None
        (an unsigned entry a lab cluster takes)."""
        if not entry.signature:
            if self.allow_unsigned:
                return None
            return Rejected(entry, RejectReason.UNSIGNED, f"{entry.key!r} by {entry.version.writer} is not signed")
        if entry.signer in self.book.revoked:
            return Rejected(entry, RejectReason.REVOKED, f"{entry.key!r}: signer {entry.signer} is revoked")
        if entry.key[0] == Kind.CERT.value and isinstance(entry.value, Certificate):
            try:
                identity = self.book.add(entry.value.der)
            except IdentityError as exc:
                return Rejected(entry, RejectReason.BAD_SIGNER, f"certificate {entry.key[2]}: {exc}")
            if identity.region != entry.key[1] or identity.fingerprint != entry.signer:
                return Rejected(entry, RejectReason.BAD_SIGNER,
                                f"certificate {entry.key[2]} of {identity.region} must be filed under its region "
                                "and sign its own entry")
        else:
            known = self.book.get(entry.signer)
            if known is None:
                return Rejected(entry, RejectReason.UNKNOWN_SIGNER,
                                f"{entry.key!r}: no trusted certificate {entry.signer!r} (yet)")
            identity = known
        agent = writer_agent(entry.version.writer)
        if agent is None or not identity.covers(*agent):
            return Rejected(entry, RejectReason.BAD_SIGNER,
                            f"{entry.key!r}: writer {entry.version.writer} is not the agent of certificate "
                            f"{identity.fingerprint} ({identity.name})")
        signed_at = physical_ms(entry.version.hlc) / 1000
        if not identity.not_before - VALIDITY_SLACK_SECONDS <= signed_at <= identity.not_after + VALIDITY_SLACK_SECONDS:
            return Rejected(entry, RejectReason.BAD_SIGNER,
                            f"{entry.key!r}: signed at {signed_at:.0f}, outside certificate {identity.fingerprint}'s "
                            "validity")
        return SignatureCheck(entry, identity, signed_bytes(entry.key, entry.version, entry.value))
