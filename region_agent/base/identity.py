"""Who an agent is, proven: an identity certificate under the cluster CA, and what its key signs.

An agent's identity certificate (the same one its gossip streams present) names its region, and
its node where the deployment can give one, in a SubjectAlternativeName URI::

    urn:region-agent:region:<region>[:node:<node>]

Kubernetes' NodeRestriction is the model: a kubelet's credential names its node and it may write
only its own Node and Pods. Here the certificate names the region, and a region's keys (copy
health, observations, its members' records) verify only with a certificate of that region. The
gossip keyring only seals datagrams; a claim inside a message is never an identity.

- :class:`Identity`: a certificate checked against the CA (issued by it, a leaf, in its validity
  window, naming a region), with its public key; :meth:`Identity.verify` checks one signature.
- :class:`CertBook`: the identities this agent trusts, by fingerprint, learned from wherever a
  certificate arrives (a TLS handshake, a push-pull row, a certificate entry of the store); every
  certificate is checked against the CA before it is kept, so any agent may relay any other's.
  Fingerprints in :attr:`CertBook.revoked` are refused.
- :class:`Signer`: this agent's private key and identity.

Signatures are ECDSA P-256 with SHA-256 (the curve of the cluster CA and its agent certificates;
about 35 µs to sign and 90 µs to verify on the reference machine) over ``context || data``, so a
signature made for one purpose (a store entry, a member record, an observation) never verifies
for another.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

URN_PREFIX = "urn:region-agent:region:"
_URN_RE = re.compile(r"urn:region-agent:region:([a-z]{3}[0-9]+)(?::node:([A-Za-z0-9][A-Za-z0-9._-]{0,127}))?")
FINGERPRINT_HEX = 32   # hex digits of a fingerprint: the first 16 bytes of SHA-256 of the DER
MAX_CERT_BYTES = 8 * 1024
MAX_BOOK = 10_000
_ECDSA = ec.ECDSA(hashes.SHA256())

# Signature contexts: one per kind of signed thing.
ENTRY = b"region-agent/entry/2\x00"
MEMBER = b"region-agent/member/2\x00"
OBSERVATION = b"region-agent/observation/2\x00"


class IdentityError(ValueError):
    """A certificate that is no identity here, or a signature that does not verify; the message says why."""


def identity_urn(region: str, node: str | None = None) -> str:
    urn = URN_PREFIX + region + ("" if node is None else f":node:{node}")
    if _URN_RE.fullmatch(urn) is None:
        raise IdentityError(f"no identity URN for region {region!r} node {node!r}")
    return urn


def fingerprint(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()[:FINGERPRINT_HEX]


def full_fingerprint(der: bytes) -> str:
    """The SHA-256 of the DER, as ``openssl x509 -fingerprint -sha256`` shows it (without colons)."""
    return hashlib.sha256(der).hexdigest()


def names_of(cert: x509.Certificate) -> tuple[str, str | None]:
    """The (region, node or None) a certificate's identity URN names; raises :class:`IdentityError`."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        sans = None
    uris = [] if sans is None else [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier)
                                    if u.startswith(URN_PREFIX)]
    if len(uris) != 1:
        raise IdentityError(f"certificate {cert.subject.rfc4514_string()} names no agent identity "
                            f"(one SAN URI {URN_PREFIX}<region>[:node:<node>]; region-agent keys cert --region)")
    match = _URN_RE.fullmatch(uris[0])
    if match is None:
        raise IdentityError(f"certificate {cert.subject.rfc4514_string()}: bad identity URN {uris[0]!r:.120}")
    return match.group(1), match.group(2)


def issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


@dataclass(frozen=True, slots=True)
class Identity:
    fingerprint: str
    region: str
    node: str | None
    not_before: float   # wall seconds
    not_after: float
    der: bytes = field(repr=False)
    public_key: ec.EllipticCurvePublicKey = field(repr=False, compare=False)

    def covers(self, region: str, node: str | None) -> bool:
        """Whether this identity may act as the agent (region, node): its region, and its node when it names one."""
        return region == self.region and (self.node is None or node == self.node)

    def valid_at(self, wall: float) -> bool:
        return self.not_before <= wall <= self.not_after

    def verify(self, context: bytes, data: bytes, signature: bytes) -> bool:
        try:
            self.public_key.verify(signature, context + data, _ECDSA)
        except (InvalidSignature, ValueError):
            return False
        return True

    @property
    def name(self) -> str:
        return self.region if self.node is None else f"{self.region}/{self.node}"


def identity_of(cert: x509.Certificate, authorities: Sequence[x509.Certificate], wall: float) -> Identity:
    """Check ``cert`` as an agent identity under ``authorities`` at ``wall``; raises :class:`IdentityError`."""
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if is_ca:
        raise IdentityError(f"certificate {cert.subject.rfc4514_string()} is a CA, not an agent")
    if not any(issued_by(cert, authority) for authority in authorities):
        raise IdentityError(f"certificate {cert.subject.rfc4514_string()} is not signed by the cluster CA")
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey) or not isinstance(public.curve, ec.SECP256R1):
        raise IdentityError(f"certificate {cert.subject.rfc4514_string()}: the key must be EC P-256")
    region, node = names_of(cert)
    der = cert.public_bytes(serialization.Encoding.DER)
    identity = Identity(fingerprint(der), region, node, cert.not_valid_before_utc.timestamp(),
                        cert.not_valid_after_utc.timestamp(), der, public)
    if not identity.valid_at(wall):
        raise IdentityError(f"certificate {cert.subject.rfc4514_string()} is not valid now "
                            f"(valid {cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d})")
    return identity


class CertBook:
    """Trusted identities by fingerprint; see the module docstring."""

    def __init__(self, authorities: Sequence[x509.Certificate], *, wall: Callable[[], float] = time.time,
                 max_size: int = MAX_BOOK) -> None:
        self._authorities = list(authorities)
        self._wall = wall
        self._max = max_size
        self._known: OrderedDict[str, Identity] = OrderedDict()
        self.revoked: frozenset[str] = frozenset()   # fingerprints (FINGERPRINT_HEX digits)
        self.listeners: list[Callable[[Identity], None]] = []   # told of every identity newly kept

    def set_authorities(self, authorities: Sequence[x509.Certificate]) -> None:
        """A rotated CA bundle: identities learned under a CA no longer in it are dropped."""
        self._authorities = list(authorities)
        for fp, identity in list(self._known.items()):
            cert = x509.load_der_x509_certificate(identity.der)
            if not any(issued_by(cert, authority) for authority in self._authorities):
                del self._known[fp]

    def set_revoked(self, fingerprints: Iterable[str]) -> None:
        self.revoked = frozenset(fp.lower()[:FINGERPRINT_HEX] for fp in fingerprints)

    def get(self, fp: str) -> Identity | None:
        """The identity with fingerprint ``fp``, or None (unknown or revoked)."""
        if fp in self.revoked:
            return None
        return self._known.get(fp)

    def add(self, der: bytes) -> Identity:
        """Check and keep a certificate (DER); returns its identity, or raises :class:`IdentityError`.

        Validity is checked at the time of adding; an identity already kept stays usable after it
        expires, for what it signed while it was valid (callers check the signed time).
        """
        if not 0 < len(der) <= MAX_CERT_BYTES:
            raise IdentityError("certificate missing or larger than 8 KiB")
        fp = fingerprint(der)
        if fp in self.revoked:
            raise IdentityError(f"certificate {fp} is revoked")
        known = self._known.get(fp)
        if known is not None:
            self._known.move_to_end(fp)
            return known
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError as exc:
            raise IdentityError(f"not a certificate: {exc}") from None
        identity = identity_of(cert, self._authorities, self._wall())
        self._known[fp] = identity
        while len(self._known) > self._max:
            self._known.popitem(last=False)
        for listener in self.listeners:
            listener(identity)
        return identity

    def __len__(self) -> int:
        return len(self._known)


class Signer:
    """This agent's identity key: signs with a context, names itself by fingerprint."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, identity: Identity) -> None:
        self._key = key
        self.identity = identity

    @property
    def fingerprint(self) -> str:
        return self.identity.fingerprint

    def sign(self, context: bytes, data: bytes) -> bytes:
        return self._key.sign(context + data, _ECDSA)
