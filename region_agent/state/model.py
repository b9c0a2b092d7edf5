"""The records of the replicated state, their keys and who owns them.

Every record is a frozen dataclass with a plain-dict codec (JSON on the wire, later in
gossip). Each key has exactly one owner, the only kind of writer allowed to change it:

| key | value | owner |
| --- | --- | --- |
| ``("region", name)`` | :class:`Region` | ``control`` (platform configuration: addresses, location) |
| ``("project", slug)`` | :class:`Project` | ``control`` (the control plane) |
| ``("copy", slug, region)`` | :class:`CopyHealth` | ``region:<region>`` |
| ``("acme", name, rdata hex)`` | :class:`Challenge` | ``acme`` (RFC 2136 updates) |
| ``("fence", region)`` | :class:`Fence` | ``control`` (a region taken out of every answer) |
| ``("cert", region, fingerprint)`` | :class:`Certificate` | ``region:<region>`` (an agent's identity certificate) |
| ``("idem", key hash)`` | :class:`Idempotency` | ``control`` (a control-API write's answer, for its retries) |

Writer ids say which owner roles they hold and which agent made the write: ``<region>/<node>``
for an agent writing its region's keys, ``control/<region>.<node>`` for an agent taking a
control-API write (or importing a zone file), ``acme/<region>.<node>`` for an agent writing what
a signed RFC 2136 UPDATE asked (:func:`agent_writer`), and ``standalone/<host>`` for a standalone
agent that is the whole system by itself and may write every key. So two agents never share a
writer id, and a signed entry's writer id names the agent whose certificate must cover it
(:func:`writer_agent`). A standalone writer's entries are never accepted from a peer
(:func:`may_merge`): replicated, its right to write every key would let it overwrite every region.

Entries are encoded with :data:`SCHEMA_VERSION`; a decoder refuses any other version.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from region_agent.base.identity import FINGERPRINT_HEX, MAX_CERT_BYTES, fingerprint
from region_agent.base.names import project_slug, region_name


class Kind(enum.StrEnum):
    REGION = "region"
    PROJECT = "project"
    COPY = "copy"
    ACME = "acme"
    FENCE = "fence"
    CERT = "cert"
    IDEM = "idem"


Key = tuple[str, ...]


class Mode(enum.StrEnum):
    """How a project's answer is chosen among its regions."""

    HA = "ha"  # ifurlup(): primary group, else healthy backups, else the all-down policy
    PROXIMITY = "proximity"  # pickclosest(): the closest healthy region to the client


class AllDownPolicy(enum.StrEnum):
    """What a project answers when none of its copies is healthy."""

    ALL = "all"  # every address of every region (ifurlup backupSelector='all')
    PRIMARY = "primary"  # the primary region's addresses
    EMPTY = "empty"  # NODATA
    SERVFAIL = "servfail"


class PartitionPolicy(enum.StrEnum):
    """A project's answer when no majority can judge a region (two regions, no witness)."""

    HOLD = "hold"  # keep answering the silent region: a partition never empties an answer
    FAILOVER = "failover"  # drop it: a dead region leaves, but a partition makes each side drop the other


class ModelError(ValueError):
    """A record that breaks the model's rules; the message names the field."""


def address_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``address`` can not be answered as an ingress or a name server (a client could never reach
    it there), or None. Loopback stays allowed: a laptop demo and the tests run on 127.0.0.x."""
    if address.is_unspecified:
        return "is the unspecified address"
    if address.is_multicast:
        return "is a multicast address"
    if address.is_link_local:
        return "is link-local (not reachable outside its link)"
    if address.version == 4 and address.is_reserved:
        return "is reserved (240.0.0.0/4, the broadcast address included)"
    return None


def _addresses(values: Any, version: int, field_name: str) -> tuple[str, ...]:
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for raw in values:
        try:
            address = ipaddress.ip_address(str(raw))
        except ValueError as exc:
            raise ModelError(f"{field_name}: {raw!r} is not an IP address") from exc
        if address.version != version:
            raise ModelError(f"{field_name}: {raw} is not an IPv{version} address")
        problem = address_problem(address)
        if problem is not None:
            raise ModelError(f"{field_name}: {raw} {problem}")
        out.append(str(address))
    return tuple(dict.fromkeys(out))


MAX_NAME_OCTETS = 255   # a DNS name in wire form (RFC 1035 §2.3.4), labels' lengths and the root included
MAX_LABEL_OCTETS = 63


def dns_name_problem(name: str) -> str | None:
    """Why the presentation-form ``name`` (no escapes) is not a DNS name, or None."""
    labels = name.rstrip(".").split(".") if name.rstrip(".") else []
    for label in labels:
        if not 0 < len(label.encode()) <= MAX_LABEL_OCTETS:
            return f"label {label[:16]!r} of {len(label)} characters (1 to {MAX_LABEL_OCTETS})"
    octets = sum(len(label.encode()) + 1 for label in labels) + 1
    if octets > MAX_NAME_OCTETS:
        return f"{octets} octets in wire form (at most {MAX_NAME_OCTETS})"
    return None


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()
    ns_ipv4: tuple[str, ...] = ()
    ns_ipv6: tuple[str, ...] = ()
    latitude: float | None = None
    longitude: float | None = None
    # A witness region votes on which regions are out and holds no copies; registering it here
    # (not its members' say-so) is what makes it count, as a dead vantage point too while it is gone.
    witness: bool = False

    def __post_init__(self) -> None:
        region_name(self.name)
        if self.witness and (self.ipv4 or self.ipv6):
            raise ModelError(f"{self.name}: a witness region serves no copies (no ipv4, no ipv6)")
        for name, version in (("ipv4", 4), ("ipv6", 6), ("ns_ipv4", 4), ("ns_ipv6", 6)):
            object.__setattr__(self, name, _addresses(getattr(self, name), version, f"{self.name}.{name}"))
        if (self.latitude is None) != (self.longitude is None):
            raise ModelError(f"{self.name}: latitude and longitude go together")
        if self.latitude is not None and not -90.0 <= self.latitude <= 90.0:
            raise ModelError(f"{self.name}.latitude {self.latitude} is outside -90..90")
        if self.longitude is not None and not -180.0 <= self.longitude <= 180.0:
            raise ModelError(f"{self.name}.longitude {self.longitude} is outside -180..180")

    def addresses(self, family: int) -> tuple[str, ...]:
        return self.ipv4 if family == 4 else self.ipv6

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "ipv4": list(self.ipv4), "ipv6": list(self.ipv6),
            "ns_ipv4": list(self.ns_ipv4), "ns_ipv6": list(self.ns_ipv6),
            "latitude": self.latitude, "longitude": self.longitude, "witness": self.witness,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Region:
        return cls(
            name=str(data["name"]), ipv4=tuple(data.get("ipv4") or ()), ipv6=tuple(data.get("ipv6") or ()),
            ns_ipv4=tuple(data.get("ns_ipv4") or ()), ns_ipv6=tuple(data.get("ns_ipv6") or ()),
            latitude=_float_or_none(data.get("latitude")), longitude=_float_or_none(data.get("longitude")),
            witness=data.get("witness") is True,
        )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class Project:
    slug: str
    regions: tuple[str, ...]
    primary: str | None = None
    mode: Mode = Mode.HA
    all_down: AllDownPolicy = AllDownPolicy.ALL
    partition: PartitionPolicy | None = None  # None: the zone's cluster.two_region_policy

    def __post_init__(self) -> None:
        project_slug(self.slug)
        if self.partition is not None:
            object.__setattr__(self, "partition", PartitionPolicy(self.partition))
        if not self.regions:
            raise ModelError(f"project {self.slug}: regions must not be empty")
        for name in self.regions:
            region_name(name)
        if len(set(self.regions)) != len(self.regions):
            raise ModelError(f"project {self.slug}: regions are listed twice")
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "all_down", AllDownPolicy(self.all_down))
        if self.mode is Mode.HA and self.primary is None:
            object.__setattr__(self, "primary", self.regions[0])
        if self.primary is not None and self.primary not in self.regions:
            raise ModelError(f"project {self.slug}: primary {self.primary} is not one of its regions")

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        """ifurlup's address sets: the primary region, then every other region as backups."""
        if self.primary is None:
            return (self.regions,)
        backups = tuple(r for r in self.regions if r != self.primary)
        return ((self.primary,), backups) if backups else ((self.primary,),)

    def to_dict(self) -> dict[str, Any]:
        return {
            "slug": self.slug, "regions": list(self.regions), "primary": self.primary,
            "mode": self.mode.value, "all_down": self.all_down.value,
            **({} if self.partition is None else {"partition": self.partition.value}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Project:
        return cls(
            slug=str(data["slug"]), regions=tuple(data["regions"]), primary=data.get("primary"),
            mode=Mode(data.get("mode", "ha")), all_down=AllDownPolicy(data.get("all_down", "all")),
            partition=None if data.get("partition") is None else PartitionPolicy(data["partition"]),
        )


@dataclass(frozen=True, slots=True)
class CopyHealth:
    """Whether a project's copy in one region serves, as its owner sees it.

    ``failed_addresses`` lists ingress addresses whose own check failed while the copy as
    a whole still serves through others (standalone HTTP checks test every address, like
    ifurlup); answers leave them out.
    """

    healthy: bool
    reason: str = "ok"
    failed_addresses: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "reason": self.reason, "failed_addresses": list(self.failed_addresses)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CopyHealth:
        return cls(
            healthy=bool(data["healthy"]), reason=str(data.get("reason", "")),
            failed_addresses=tuple(data.get("failed_addresses") or ()),
        )


@dataclass(frozen=True, slots=True)
class Challenge:
    """One ACME DNS-01 challenge TXT record, as a signed RFC 2136 UPDATE added it.

    ``rdata`` is the TXT record's wire form (its strings) exactly as sent; the key names it
    too, so two values at one name (a certificate for a name and its wildcard) are two
    records that gossip and delete independently. ``expires_at`` (Unix seconds) bounds a
    record whose delete never came.
    """

    name: str  # absolute, lower case: _acme-challenge.<name>.<zone>.
    rdata: bytes
    ttl: int
    expires_at: int

    def __post_init__(self) -> None:
        if not self.name.endswith(".") or self.name != self.name.lower() or not self.name.isascii():
            raise ModelError(f"challenge name {self.name!r} must be absolute, ASCII and lower case")
        problem = dns_name_problem(self.name)
        if problem is not None:  # a peer's entry: the compiler would otherwise fail on it at every agent
            raise ModelError(f"challenge name {self.name[:64]!r}... is not a DNS name: {problem}")
        if not 0 < len(self.rdata) <= 65535 or not 0 <= self.ttl < 2**31 or self.expires_at < 0:
            raise ModelError(f"challenge {self.name}: bad rdata, ttl or expiry")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rdata": self.rdata.hex(), "ttl": self.ttl, "expires_at": self.expires_at}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Challenge:
        return cls(name=str(data["name"]), rdata=bytes.fromhex(str(data["rdata"])), ttl=int(data["ttl"]),
                   expires_at=int(data["expires_at"]))


@dataclass(frozen=True, slots=True)
class Fence:
    """A region the control plane took out of every answer, whatever its copies report.

    Unfencing deletes the record (a tombstone), so fencing follows last-writer-wins like
    any other control write.
    """

    region: str
    reason: str = ""

    def __post_init__(self) -> None:
        region_name(self.region)
        if len(self.reason) > 256:
            raise ModelError(f"fence {self.region}: reason is longer than 256 characters")

    def to_dict(self) -> dict[str, Any]:
        return {"region": self.region, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fence:
        return cls(region=str(data["region"]), reason=str(data.get("reason") or ""))


@dataclass(frozen=True, slots=True)
class Certificate:
    """An agent's identity certificate (DER), in the store so that any agent can verify what it
    signed, whoever relays it, long after it left. The key names its region and fingerprint; the
    entry's verifier checks the certificate against the cluster CA."""

    der: bytes

    def __post_init__(self) -> None:
        if not 0 < len(self.der) <= MAX_CERT_BYTES:
            raise ModelError("certificate must be 1 to 8192 bytes of DER")

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.der)

    def to_dict(self) -> dict[str, Any]:
        return {"der": base64.b64encode(self.der).decode()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Certificate:
        try:
            return cls(base64.b64decode(str(data["der"]), validate=True))
        except binascii.Error as exc:
            raise ModelError(f"certificate: not base64: {exc}") from None


@dataclass(frozen=True, slots=True)
class Idempotency:
    """The answer to a control-API write, kept so a retry of it at any agent (or after a restart) replays
    it: the request's fingerprint, the status, the body (JSON text) and the headers worth replaying."""

    fingerprint: str
    status: int
    body: str
    headers: tuple[tuple[str, str], ...]
    expires_at: int   # wall seconds

    def __post_init__(self) -> None:
        if len(self.fingerprint) != 64 or not 200 <= self.status < 300 or len(self.body) > MAX_IDEMPOTENT_BODY:
            raise ModelError("idempotency record: bad fingerprint, status or body")
        if len(self.headers) > 8 or any(len(k) > 64 or len(v) > 512 for k, v in self.headers):
            raise ModelError("idempotency record: too many or too long headers")

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "status": self.status, "body": self.body,
                "headers": [list(h) for h in self.headers], "expires_at": self.expires_at}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Idempotency:
        return cls(str(data["fingerprint"]), int(data["status"]), str(data["body"]),
                   tuple((str(k), str(v)) for k, v in data.get("headers") or ()), int(data["expires_at"]))


MAX_IDEMPOTENT_BODY = 2048   # bytes of an answer kept for its retries (a project's or a region's)

Value = Region | Project | CopyHealth | Challenge | Fence | Certificate | Idempotency

_CODECS: dict[Kind, type[Region] | type[Project] | type[CopyHealth] | type[Challenge] | type[Fence]
              | type[Certificate] | type[Idempotency]] = {
    Kind.REGION: Region,
    Kind.PROJECT: Project,
    Kind.COPY: CopyHealth,
    Kind.ACME: Challenge,
    Kind.FENCE: Fence,
    Kind.CERT: Certificate,
    Kind.IDEM: Idempotency,
}


def region_key(name: str) -> Key:
    return (Kind.REGION.value, name)


def project_key(slug: str) -> Key:
    return (Kind.PROJECT.value, slug)


def copy_key(slug: str, region: str) -> Key:
    return (Kind.COPY.value, slug, region)


def challenge_key(name: str, rdata: bytes) -> Key:
    return (Kind.ACME.value, name, rdata.hex())


def fence_key(region: str) -> Key:
    return (Kind.FENCE.value, region)


def cert_key(region: str, cert: Certificate) -> Key:
    return (Kind.CERT.value, region, cert.fingerprint)


def idempotency_key(key: str) -> Key:
    """The store key of a control-API idempotency key (hashed: the key is the client's text)."""
    return (Kind.IDEM.value, hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32])


_SHAPES: dict[str, tuple[Kind, int]] = {Kind.REGION.value: (Kind.REGION, 2), Kind.PROJECT.value: (Kind.PROJECT, 2),
                                         Kind.COPY.value: (Kind.COPY, 3), Kind.ACME.value: (Kind.ACME, 3),
                                         Kind.FENCE.value: (Kind.FENCE, 2), Kind.CERT.value: (Kind.CERT, 3),
                                         Kind.IDEM.value: (Kind.IDEM, 2)}


def check_key(key: Key) -> Kind:
    """Validate the shape of a key (keys arrive from peers) and return its kind."""
    try:
        kind, arity = _SHAPES[key[0]]
    except (KeyError, IndexError, TypeError) as exc:
        raise ModelError(f"unknown key {key!r}") from exc
    if len(key) != arity or not all(isinstance(part, str) for part in key):
        raise ModelError(f"key {key!r} must be {arity} strings")
    return kind


def owner_of(key: Key) -> str:
    kind = check_key(key)
    if kind is Kind.COPY:
        return f"region:{key[2]}"
    if kind is Kind.CERT:
        return f"region:{key[1]}"
    if kind is Kind.ACME:
        return ACME
    return "control"


STANDALONE = "standalone"
CONTROL = "control"
ACME = "acme"

# The version of the entry encoding (``region_agent.state.store.entry_to_json``). Bump it when a
# record's shape changes in a way an older agent would misread; an agent refuses entries
# of a version it does not know rather than guess at them. 2: signed entries (signer, sig),
# certificate records, writer ids naming the agent.
SCHEMA_VERSION = 2


def agent_writer(role: str, region: str, node: str) -> str:
    """The writer id of agent (region, node) acting as ``role``: a region name (its own region's
    keys), ``control`` or ``acme``."""
    return f"{region}/{node}" if role == region else f"{role}/{region}.{node}"


def role_writer(own: str, role: str) -> str:
    """The writer id this agent (writer id ``own``) uses for ``role`` (``control``, ``acme``)."""
    agent = writer_agent(own)
    if agent is None:
        return f"{role}/{own.partition('/')[2]}"
    return agent_writer(role, *agent)


def writer_agent(writer: str) -> tuple[str, str] | None:
    """The (region, node) of the agent a writer id names, or None (standalone, or an old-style id)."""
    role, _, node = writer.partition("/")
    if role in (CONTROL, ACME):
        region, dot, rest = node.partition(".")
        if not dot or not rest:
            return None
        try:
            return region_name(region), rest
        except ValueError:
            return None
    if role == STANDALONE:
        return None
    return role, node


def writer_role(writer: str) -> str:
    """The role of a writer id ``<role>/<node>``: a region name, ``control`` or ``standalone``.

    Raises :class:`ModelError` for anything else (writer ids arrive from peers).
    """
    role, slash, node = writer.partition("/")
    if not slash or not node or "/" in node:
        raise ModelError(f"writer id {writer!r} must be <role>/<node>")
    if role not in (STANDALONE, CONTROL, ACME):
        try:
            region_name(role)
        except ValueError as exc:
            raise ModelError(f"writer id {writer!r}: role must be a region, {CONTROL} or {STANDALONE}") from exc
    return role


def may_write(writer: str, key: Key) -> bool:
    """Whether a writer id holds the owner role of ``key`` (see the module docstring)."""
    scope, _, _ = writer.partition("/")
    if scope == STANDALONE:
        return True
    owner = owner_of(key)
    if scope in (CONTROL, ACME):
        return owner == scope
    return owner == f"region:{scope}"


def may_merge(writer: str, key: Key) -> bool:
    """Whether an entry of ``writer`` for ``key`` may come from a peer: its owner, never standalone."""
    return writer_role(writer) != STANDALONE and may_write(writer, key)


def value_matches(key: Key, value: Value) -> bool:
    """Whether ``value`` is the record type of ``key``'s kind and names the same key."""
    kind = check_key(key)
    if not isinstance(value, _CODECS[kind]):
        return False
    if isinstance(value, Region):
        return value.name == key[1]
    if isinstance(value, Project):
        return value.slug == key[1]
    if isinstance(value, Challenge):
        return (value.name, value.rdata.hex()) == key[1:]
    if isinstance(value, Fence):
        return value.region == key[1]
    if isinstance(value, Certificate):
        return len(key[2]) == FINGERPRINT_HEX and value.fingerprint == key[2]
    return True


def encode_value(value: Value) -> dict[str, Any]:
    return value.to_dict()


def decode_value(key: Key, data: dict[str, Any]) -> Value:
    kind = check_key(key)
    try:
        value = _CODECS[kind].from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"bad {kind.value} record for {key!r}: {exc}") from exc
    if not value_matches(key, value):
        raise ModelError(f"record for {key!r} names another key")
    return value
