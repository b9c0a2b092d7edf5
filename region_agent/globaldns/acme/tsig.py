"""TSIG (RFC 8945) for RFC 2136 UPDATE: the keyring, request verification, response signing.

dnspython does the cryptography (HMAC-MD5 for cert-manager's default, SHA-1, SHA-256,
SHA-512); this module decides what each failure means on the wire:

- no TSIG at all → NOTAUTH, unsigned (there is no key to answer with);
- an unknown key name or a key used with another algorithm → NOTAUTH + TSIG error BADKEY,
  with no MAC (RFC 8945 §5.2.1, §5.3.2);
- a MAC that does not verify → NOTAUTH + BADSIG, with no MAC (§5.2.2);
- a time outside the fudge → NOTAUTH + BADTIME, *signed*, the server's time in Other Data
  (§5.2.3), so the client can tell a skewed clock from an attack.

A TSIG-signed QUERY (certbot's SOA lookup) is verified the same way and its answer signed with
the same key, the request's MAC included (§5.3). :func:`peek` reads a message's TSIG owner without
dnspython, so unsigned junk is refused before the ~300 µs parse; :func:`sign_wire` signs a response
rendered by the answer path as it is.

UPDATE is rare and never on the query fast path, so dnspython's ~300 µs per message is fine.
"""

from __future__ import annotations

import base64
import binascii
import enum
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.ANY.TSIG
import dns.tsig

# cert-manager's names (case-insensitive) and the usual DNS ones → the algorithm.
ALGORITHMS: dict[str, dns.name.Name] = {
    "hmac-md5": dns.tsig.HMAC_MD5, "hmacmd5": dns.tsig.HMAC_MD5, "hmac-md5.sig-alg.reg.int": dns.tsig.HMAC_MD5,
    "hmac-sha1": dns.tsig.HMAC_SHA1, "hmacsha1": dns.tsig.HMAC_SHA1,
    "hmac-sha256": dns.tsig.HMAC_SHA256, "hmacsha256": dns.tsig.HMAC_SHA256,
    "hmac-sha512": dns.tsig.HMAC_SHA512, "hmacsha512": dns.tsig.HMAC_SHA512,
}
FUDGE = 300  # seconds; what cert-manager and nsupdate send
MIN_SECRET = 16  # bytes: a shorter HMAC key is a configuration mistake, not a key


class TsigConfigError(ValueError):
    """A key that can not be used; the message names it."""


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One configured key: its name, algorithm and base64 secret (as cert-manager and BIND take it)."""

    name: str
    algorithm: str
    secret: str


class TsigKeyring:
    """The keys UPDATE may be signed with; several at once, so a key can be rotated."""

    def __init__(self, specs: Iterable[KeySpec] = ()) -> None:
        self.specs = list(specs)
        self.keys: dict[dns.name.Name, dns.tsig.Key] = {}
        for spec in self.specs:
            key = _key(spec)
            if key.name in self.keys:
                raise TsigConfigError(f"TSIG key {spec.name!r} is given twice")
            self.keys[key.name] = key

    def __len__(self) -> int:
        return len(self.keys)

    def lookup(self, _message: object, name: dns.name.Name) -> dns.tsig.Key | None:
        """dnspython's callable keyring: the key of that name, None when unknown."""
        return self.keys.get(name)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Mapping[str, str]]) -> TsigKeyring:
        """From ``{name: {algorithm: ..., secret: ...}}`` (a mounted Secret's YAML or JSON)."""
        specs = []
        for name, fields in data.items():
            if not isinstance(fields.get("secret"), str):
                raise TsigConfigError(f"TSIG key {name!r}: needs a base64 `secret` (and an `algorithm`)")
            specs.append(KeySpec(str(name), str(fields.get("algorithm", "hmac-sha256")), fields["secret"]))
        return cls(specs)


def _key(spec: KeySpec) -> dns.tsig.Key:
    algorithm = ALGORITHMS.get(spec.algorithm.strip().lower().rstrip("."))
    if algorithm is None:
        raise TsigConfigError(f"TSIG key {spec.name!r}: algorithm {spec.algorithm!r} is not one of "
                              "hmac-md5, hmac-sha1, hmac-sha256, hmac-sha512")
    try:
        secret = base64.b64decode(spec.secret, validate=True)
        name = dns.name.from_text(spec.name)
    except (binascii.Error, ValueError, dns.exception.DNSException) as exc:
        raise TsigConfigError(f"TSIG key {spec.name!r}: {exc}") from None
    if len(secret) < MIN_SECRET:
        raise TsigConfigError(f"TSIG key {spec.name!r}: the secret is {len(secret)} bytes; at least {MIN_SECRET}")
    return dns.tsig.Key(name, secret, algorithm)


class Verdict(enum.Enum):
    OK = "ok"
    UNSIGNED = "unsigned"
    BADKEY = "badkey"
    BADSIG = "badsig"
    BADTIME = "badtime"


@dataclass(frozen=True)
class Verified:
    """A parsed request and what its TSIG says; ``key`` is set when the key is ours."""

    message: dns.message.Message
    verdict: Verdict
    key: dns.tsig.Key | None = None


class UnparseableError(Exception):
    """The message can not be parsed at all (FORMERR, or dropped when even the header is short)."""


def verify(wire: bytes, keyring: TsigKeyring, *, now: float | None = None) -> Verified:
    """Parse ``wire`` and check its TSIG against ``keyring`` (MAC first, then time, as §5.2 orders).

    The time window is the request's fudge but never more than :data:`FUDGE`: the replay cache
    remembers a MAC that long, so a request may not widen its own window past it.
    """
    try:
        message = dns.message.from_wire(wire, keyring=keyring.lookup)
    except (dns.message.UnknownTSIGKey, dns.tsig.BadKey, dns.tsig.BadAlgorithm):
        return Verified(_unverified(wire), Verdict.BADKEY)
    except dns.tsig.BadSignature:
        return Verified(_unverified(wire), Verdict.BADSIG)
    except dns.tsig.BadTime:
        message = _unverified(wire)
        return Verified(message, Verdict.BADTIME, _known(keyring, message))
    except dns.tsig.PeerError:  # a request carrying a TSIG error code: nothing to verify
        return Verified(_unverified(wire), Verdict.BADSIG)
    except (dns.exception.DNSException, ValueError, struct.error, IndexError) as exc:
        raise UnparseableError(str(exc) or type(exc).__name__) from None
    _must_be_request(message)
    if message.tsig is None:
        return Verified(message, Verdict.UNSIGNED)
    if not within_window(message, time.time() if now is None else now):
        return Verified(message, Verdict.BADTIME, _known(keyring, message))
    return Verified(message, Verdict.OK, _known(keyring, message))


def within_window(message: dns.message.Message, now: float) -> bool:
    """Whether the request's time is within min(its fudge, :data:`FUDGE`) of ``now``."""
    assert message.tsig is not None
    rdata = message.tsig[0]
    return bool(abs(now - rdata.time_signed) <= min(rdata.fudge, FUDGE))


@dataclass(frozen=True, slots=True)
class Peek:
    """Where a message's TSIG record starts (``len(wire)`` when it has none) and whose key it names."""

    keyname: dns.name.Name | None
    start: int


def peek(wire: bytes) -> Peek | None:
    """The last record of the message if it is a TSIG, read without dnspython; None when the walk fails.

    A few microseconds, so junk is sorted out before the parse and the MAC check.
    """
    try:
        qdcount, ancount, nscount, arcount = struct.unpack_from("!HHHH", wire, 4)
        offset = 12
        for _ in range(qdcount):
            offset = _skip_name(wire, offset) + 4
        last = offset
        for _ in range(ancount + nscount + arcount):
            last = offset
            offset = _skip_name(wire, offset)
            rtype, rdlen = struct.unpack_from("!H6xH", wire, offset)
            offset += 10 + rdlen
        if offset > len(wire):
            return None
        if arcount and rtype == dns.rdatatype.TSIG:
            return Peek(dns.name.from_wire(wire, last)[0], last)
        return Peek(None, len(wire))
    except (ValueError, struct.error, IndexError, dns.exception.DNSException):
        return None


def _skip_name(wire: bytes, offset: int) -> int:
    while True:
        length = wire[offset]
        if length == 0:
            return offset + 1
        if length & 0xC0 == 0xC0:
            return offset + 2
        if length & 0xC0:
            raise ValueError("extended label type")
        offset += length + 1


def strip_tsig(wire: bytes, where: Peek) -> bytes:
    """The message without its TSIG record (ARCOUNT one less), for the unsigned answer path."""
    (arcount,) = struct.unpack_from("!H", wire, 10)
    return wire[:10] + struct.pack("!H", arcount - 1) + wire[12:where.start]


def tsig_size(key: dns.tsig.Key) -> int:
    """Bytes a TSIG record signed with ``key`` adds to a response (no other data)."""
    mac = {dns.tsig.HMAC_MD5: 16, dns.tsig.HMAC_SHA1: 20, dns.tsig.HMAC_SHA256: 32}.get(key.algorithm, 64)
    return len(key.name.to_wire() or b"") + 10 + len(key.algorithm.to_wire() or b"") + 16 + mac


def sign_wire(wire: bytes, key: dns.tsig.Key, request_mac: bytes, *, original_id: int,
              now: int | None = None) -> bytes:
    """``wire`` (a rendered response) with a TSIG record signed by ``key`` over it and the request's MAC."""
    now = int(time.time()) if now is None else now
    template = dns.rdtypes.ANY.TSIG.TSIG(dns.rdataclass.ANY, dns.rdatatype.TSIG, key.algorithm, now, FUDGE, b"",
                                         original_id, 0, b"")  # type: ignore[no-untyped-call]
    rdata, _ = dns.tsig.sign(wire, key, template, now, request_mac)  # type: ignore[no-untyped-call]
    body = rdata.to_wire() or b""
    record = (key.name.to_wire() or b"") + struct.pack("!HHIH", dns.rdatatype.TSIG, dns.rdataclass.ANY, 0,
                                                       len(body)) + body
    (arcount,) = struct.unpack_from("!H", wire, 10)
    return wire[:10] + struct.pack("!H", arcount + 1) + wire[12:] + record


def _known(keyring: TsigKeyring, message: dns.message.Message) -> dns.tsig.Key | None:
    return None if message.keyname is None else keyring.keys.get(message.keyname)


def _unverified(wire: bytes) -> dns.message.Message:
    try:
        message = dns.message.from_wire(wire, keyring=False)
    except (dns.exception.DNSException, ValueError, struct.error, IndexError) as exc:
        raise UnparseableError(str(exc) or type(exc).__name__) from None
    _must_be_request(message)
    return message


def _must_be_request(message: dns.message.Message) -> None:
    """A response (QR set) is never answered: answering answers invites loops and reflection."""
    if message.flags & dns.flags.QR:
        raise UnparseableError("a response, not a request")


def respond(verified: Verified, rcode: int, *, now: int | None = None) -> bytes:
    """The response to an UPDATE: the zone section echoed, the rcode, and the TSIG the verdict calls for."""
    request = verified.message
    response = dns.message.make_response(request)
    response.set_rcode(dns.rcode.Rcode(rcode))
    if verified.verdict is Verdict.OK:
        return _wire(response)  # make_response signed it with the request's key and MAC
    now = int(time.time()) if now is None else now
    if verified.verdict is Verdict.BADTIME and verified.key is not None:
        response.use_tsig(verified.key, tsig_error=dns.rcode.BADTIME, other_data=struct.pack(
            "!HI", now >> 32 & 0xFFFF, now & 0xFFFFFFFF), original_id=request.id)
        response.request_mac = request.mac or b""
        return _wire(response)
    wire = _unsigned(response)
    if verified.verdict in (Verdict.BADKEY, Verdict.BADSIG) and request.tsig is not None:
        error = dns.rcode.BADKEY if verified.verdict is Verdict.BADKEY else dns.rcode.BADSIG
        return _append_error_tsig(wire, request, error, now)
    return wire


def _unsigned(response: dns.message.Message) -> bytes:
    response.keyring = None
    response.tsig = None
    return _wire(response)


def _wire(message: dns.message.Message) -> bytes:
    wire = message.to_wire()
    assert wire is not None  # only None when writing into a caller's file
    return wire


def _append_error_tsig(wire: bytes, request: dns.message.Message, error: int, now: int) -> bytes:
    """A TSIG record carrying ``error`` and no MAC (RFC 8945 §5.3.2: BADKEY and BADSIG are unsigned)."""
    assert request.keyname is not None and request.tsig is not None
    original = request.tsig[0]
    algorithm = original.algorithm.to_wire() or b""
    rdata = (algorithm + struct.pack("!HIH", now >> 32 & 0xFFFF, now & 0xFFFFFFFF, FUDGE) + struct.pack("!H", 0)
             + struct.pack("!HHH", original.original_id, error, 0))
    owner = request.keyname.to_wire() or b""
    record = owner + struct.pack("!HHIH", dns.rdatatype.TSIG, dns.rdataclass.ANY, 0, len(rdata)) + rdata
    (arcount,) = struct.unpack_from("!H", wire, 10)
    return wire[:10] + struct.pack("!H", arcount + 1) + wire[12:] + record
