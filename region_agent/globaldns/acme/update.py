"""RFC 2136 UPDATE, restricted to ACME challenge TXT records: pure decisions, no I/O.

:func:`plan_update` takes a parsed (and already TSIG-verified) UPDATE, the challenge records
the zone holds now, and a view of the rest of the zone for prerequisites, and returns the
rcode and the changes to make — all of them or none. The order of checks is the RFC's:
zone section (§3.1), prerequisites (§3.2), a prescan of the update section (§3.4.1), then
this server's policy, then the changes applied in order on a copy (§3.4.2) and the limits
checked on the result.

Policy: only TXT records whose owner's first label is ``_acme-challenge`` and which lie
below the apex may be added or deleted (delete-RR, delete-RRset, delete-name at such a
name). Anything else — another type, another name, the apex's SOA or NS — is REFUSED and
changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

ACME_LABEL = b"_acme-challenge"
TXT = dns.rdatatype.TXT
META_TYPES = frozenset({dns.rdatatype.ANY, dns.rdatatype.AXFR, dns.rdatatype.MAILA, dns.rdatatype.MAILB,
                        dns.rdatatype.IXFR, dns.rdatatype.OPT, dns.rdatatype.TSIG})

# name (lower-case text, absolute) → {TXT rdata wire: TTL}
Records = Mapping[str, Mapping[bytes, int]]


@dataclass(frozen=True, slots=True)
class UpdateLimits:
    max_value_length: int = 512  # bytes of one TXT rdata; a challenge digest is 43
    max_per_name: int = 16  # values at one name (a wildcard and its apex share a name: 2)
    max_total: int = 1024  # challenge records in the zone
    max_ttl: int = 86_400  # seconds; ACME clients ask 10-120 (a TTL of 2^31 or more broke the store's check)


@dataclass(frozen=True, slots=True)
class ZoneFacts:
    """What prerequisites may ask of the zone's other names (the compiled tables answer)."""

    has_name: Callable[[str], bool]
    rrset: Callable[[str, int], frozenset[bytes] | None]


NO_OTHER_NAMES = ZoneFacts(lambda _name: False, lambda _name, _rdtype: None)


@dataclass
class UpdatePlan:
    rcode: int
    reason: str  # a short token for metrics: ok, formerr, notzone, refused-type, over-limit, ...
    adds: list[tuple[str, bytes, int]] = field(default_factory=list)  # (name, rdata, ttl)
    removes: list[tuple[str, bytes]] = field(default_factory=list)  # (name, rdata)

    @property
    def changes(self) -> int:
        return len(self.adds) + len(self.removes)


def _refuse(rcode: int, reason: str) -> UpdatePlan:
    return UpdatePlan(rcode, reason)


def _name(name: dns.name.Name) -> str:
    return name.to_text().lower()


def is_challenge_name(name: dns.name.Name, apex: dns.name.Name) -> bool:
    return (name != apex and name.is_subdomain(apex) and len(name.labels) > 0
            and name.labels[0].lower() == ACME_LABEL)


def plan_update(message: dns.message.Message, apex: dns.name.Name, records: Records, *,
                zone: ZoneFacts = NO_OTHER_NAMES, limits: UpdateLimits | None = None) -> UpdatePlan:
    """Decide an UPDATE: the rcode, and every change to make when it is NOERROR."""
    limits = limits or UpdateLimits()
    # §3.1: exactly one zone, of type SOA, and ours.
    zones = message.sections[0]
    if len(zones) != 1 or zones[0].rdtype != dns.rdatatype.SOA:
        return _refuse(dns.rcode.FORMERR, "formerr")
    if zones[0].name != apex or zones[0].rdclass != dns.rdataclass.IN:
        return _refuse(dns.rcode.NOTAUTH, "notauth")
    # §3.2: prerequisites.
    for rrset in message.sections[1]:
        problem = _prerequisite(rrset, apex, records, zone)
        if problem is not None:
            return problem
    # §3.4.1: prescan, then this server's policy.
    updates = message.sections[2]
    for rrset in updates:
        problem = _prescan(rrset, apex)
        if problem is not None:
            return problem
    for rrset in updates:
        if not is_challenge_name(rrset.name, apex):
            return _refuse(dns.rcode.REFUSED, "refused-name")
        deleting = getattr(rrset, "deleting", None)
        if rrset.rdtype != TXT and not (deleting == dns.rdataclass.ANY and rrset.rdtype == dns.rdatatype.ANY):
            return _refuse(dns.rcode.REFUSED, "refused-type")
    # §3.4.2: apply in order on a copy, then check the limits on the result.
    after = {name: dict(values) for name, values in records.items()}
    for rrset in updates:
        name = _name(rrset.name)
        deleting = getattr(rrset, "deleting", None)
        if deleting is None:
            if not 0 <= rrset.ttl <= limits.max_ttl:
                return _refuse(dns.rcode.REFUSED, "over-limit")
            values = after.setdefault(name, {})
            for rdata in rrset:
                wire = rdata.to_wire()
                if len(wire) > limits.max_value_length:
                    return _refuse(dns.rcode.REFUSED, "over-limit")
                values[wire] = rrset.ttl
        elif deleting == dns.rdataclass.ANY:
            after.pop(name, None)  # delete-RRset of TXT or delete-name: only TXT lives here
        else:
            remaining = after.get(name, {})
            for rdata in rrset:
                remaining.pop(rdata.to_wire(), None)
    after = {name: values for name, values in after.items() if values}
    if any(len(values) > limits.max_per_name for values in after.values()):
        return _refuse(dns.rcode.REFUSED, "over-limit")
    if sum(len(values) for values in after.values()) > limits.max_total:
        return _refuse(dns.rcode.REFUSED, "over-limit")
    plan = UpdatePlan(dns.rcode.NOERROR, "ok")
    for name, values in after.items():
        before = records.get(name, {})
        plan.adds.extend((name, wire, ttl) for wire, ttl in values.items() if before.get(wire) != ttl)
    for name, held in records.items():
        plan.removes.extend((name, wire) for wire in held if wire not in after.get(name, {}))
    return plan


def _prerequisite(rrset: dns.rrset.RRset, apex: dns.name.Name, records: Records,
                  zone: ZoneFacts) -> UpdatePlan | None:
    if rrset.ttl != 0:
        return _refuse(dns.rcode.FORMERR, "formerr")
    if not rrset.name.is_subdomain(apex):
        return _refuse(dns.rcode.NOTZONE, "notzone")
    name = _name(rrset.name)
    deleting = getattr(rrset, "deleting", None)

    def present(rdtype: int) -> frozenset[bytes] | None:
        if rdtype == TXT and name in records:
            return frozenset(records[name])
        return zone.rrset(name, rdtype)

    in_use = name in records or zone.has_name(name)
    if deleting == dns.rdataclass.ANY:
        if len(rrset):
            return _refuse(dns.rcode.FORMERR, "formerr")
        if rrset.rdtype == dns.rdatatype.ANY:
            return None if in_use else _refuse(dns.rcode.NXDOMAIN, "prerequisite")
        return None if present(rrset.rdtype) else _refuse(dns.rcode.NXRRSET, "prerequisite")
    if deleting == dns.rdataclass.NONE:
        if len(rrset):
            return _refuse(dns.rcode.FORMERR, "formerr")
        if rrset.rdtype == dns.rdatatype.ANY:
            return _refuse(dns.rcode.YXDOMAIN, "prerequisite") if in_use else None
        return _refuse(dns.rcode.YXRRSET, "prerequisite") if present(rrset.rdtype) else None
    if rrset.rdclass != dns.rdataclass.IN or rrset.rdtype in META_TYPES:
        return _refuse(dns.rcode.FORMERR, "formerr")
    wanted = frozenset(rdata.to_wire() for rdata in rrset)
    return None if present(rrset.rdtype) == wanted else _refuse(dns.rcode.NXRRSET, "prerequisite")


def _prescan(rrset: dns.rrset.RRset, apex: dns.name.Name) -> UpdatePlan | None:
    if not rrset.name.is_subdomain(apex):
        return _refuse(dns.rcode.NOTZONE, "notzone")
    deleting = getattr(rrset, "deleting", None)
    if deleting is None:
        if rrset.rdclass != dns.rdataclass.IN or rrset.rdtype in META_TYPES:
            return _refuse(dns.rcode.FORMERR, "formerr")
    elif deleting == dns.rdataclass.ANY:
        if rrset.ttl != 0 or len(rrset) or rrset.rdtype in META_TYPES - {dns.rdatatype.ANY}:
            return _refuse(dns.rcode.FORMERR, "formerr")
    elif deleting == dns.rdataclass.NONE:
        if rrset.ttl != 0 or rrset.rdtype in META_TYPES:
            return _refuse(dns.rcode.FORMERR, "formerr")
    else:
        return _refuse(dns.rcode.FORMERR, "formerr")
    return None
