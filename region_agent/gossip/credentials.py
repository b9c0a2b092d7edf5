"""Signed member records: a member is what its own identity key says it is, not what a packet claims.

Every alive (and every push-pull row) carries the member's :class:`~region_agent.gossip.messages.Proof`:
the fingerprint of its identity certificate and its signature over the member record
(:func:`~region_agent.gossip.messages.member_bytes`: name, region, node, role, address, metadata,
incarnation). The membership keeps a member only when the proof checks: the certificate is
trusted (under the cluster CA, learned from a TLS handshake, a push-pull row or the store), covers
the member's region (and node, when it names one), and the signature verifies. So a holder of the
gossip keyring alone can not add a member, move one, or speak for another region: a member without
a valid signed record is not a member, does not vote and is not probed.

:class:`IdentityCredentials` is the real one; the simulator and lab clusters run without
credentials (every record is taken, as memberlist does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from region_agent.base.identity import MEMBER, CertBook, IdentityError, Signer
from region_agent.gossip.messages import Member, Proof, member_bytes


class Credentials(Protocol):
    def prove(self, member: Member) -> Proof:
        """This agent's proof of its own record."""
        ...

    def check(self, member: Member, proof: Proof, cert: bytes = b"") -> str | None:
        """None when ``proof`` proves ``member`` (``cert``: the certificate that came with it, if any);
        else a short reason for the rejected-messages counter."""
        ...

    def certificate(self, proof: Proof) -> bytes:
        """The certificate (DER) behind ``proof``, to pass on in a push-pull row; empty when unknown."""
        ...


class IdentityCredentials:
    def __init__(self, book: CertBook, signer: Callable[[], Signer]) -> None:
        """``signer``: the current identity key (it changes when the certificate files rotate)."""
        self.book = book
        self._signer = signer

    def prove(self, member: Member) -> Proof:
        signer = self._signer()
        return Proof(signer.fingerprint, signer.sign(MEMBER, member_bytes(member)))

    def check(self, member: Member, proof: Proof, cert: bytes = b"") -> str | None:
        if not proof:
            return "unsigned"
        if cert:
            try:
                self.book.add(cert)
            except IdentityError:
                return "bad-certificate"
        identity = self.book.get(proof.signer)
        if identity is None:
            return "revoked" if proof.signer in self.book.revoked else "unknown-signer"
        if not identity.covers(member.region, member.node):
            return "wrong-signer"
        if not identity.verify(MEMBER, member_bytes(member), proof.signature):
            return "bad-signature"
        return None

    def certificate(self, proof: Proof) -> bytes:
        own = self._signer().identity
        if proof.signer == own.fingerprint:
            return own.der
        identity = self.book.get(proof.signer)
        return b"" if identity is None else identity.der
