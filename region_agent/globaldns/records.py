"""Pre-rendered resource records whose names point into the question.

A response copies the question verbatim at offset 12, so any name that equals the query
name, or ends in one of its suffixes (the zone apex, say), is written as a compression
pointer into it. Records rendered for one query name are therefore valid for every query
of that name, in any letter case, and take no work at answer time.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from region_agent.globaldns.wire import AAAA, CLASS_IN, HINFO, NS, SOA, TXT, A

QUESTION_OFFSET = 12


def suffix_offsets(qname: bytes, at: int = QUESTION_OFFSET) -> dict[bytes, int]:
    """Every label-boundary suffix of a (lower-case wire) name written at offset ``at`` → its offset."""
    offsets: dict[bytes, int] = {}
    i = 0
    while qname[i]:
        offsets[qname[i:]] = at + i
        i += qname[i] + 1
    return offsets


def encode_name(name: bytes, suffixes: dict[bytes, int]) -> bytes:
    """``name`` as leading labels plus a pointer to the longest suffix already in the question."""
    i = 0
    while name[i]:
        offset = suffixes.get(name[i:])
        if offset is not None:
            return name[:i] + struct.pack("!H", 0xC000 | offset)
        i += name[i] + 1
    return name


@dataclass(frozen=True, slots=True)
class Section:
    """Rendered records of one message section and how many there are."""

    count: int = 0
    data: bytes = b""

    def __add__(self, other: Section) -> Section:
        return Section(self.count + other.count, self.data + other.data)


EMPTY = Section()


def _rr(owner: bytes, rtype: int, ttl: int, rdata: bytes) -> bytes:
    return owner + struct.pack("!HHIH", rtype, CLASS_IN, ttl, len(rdata)) + rdata


def address_records(owner: bytes, addresses: tuple[str, ...], ttl: int, suffixes: dict[bytes, int]) -> Section:
    """A or AAAA records (by each address's family) for ``owner``."""
    encoded_owner = encode_name(owner, suffixes)
    out = bytearray()
    for text in addresses:
        address = ipaddress.ip_address(text)
        rtype = A if address.version == 4 else AAAA
        out += _rr(encoded_owner, rtype, ttl, address.packed)
    return Section(len(addresses), bytes(out))


def ns_records(owner: bytes, hosts: tuple[bytes, ...], ttl: int, suffixes: dict[bytes, int]) -> Section:
    encoded_owner = encode_name(owner, suffixes)
    out = bytearray()
    for host in hosts:
        out += _rr(encoded_owner, NS, ttl, encode_name(host, suffixes))
    return Section(len(hosts), bytes(out))


@dataclass(frozen=True, slots=True)
class SoaFields:
    mname: bytes
    rname: bytes
    serial: int
    refresh: int
    retry: int
    expire: int
    minimum: int


def soa_record(owner: bytes, soa: SoaFields, ttl: int, suffixes: dict[bytes, int]) -> Section:
    rdata = (
        encode_name(soa.mname, suffixes)
        + encode_name(soa.rname, suffixes)
        + struct.pack("!IIIII", soa.serial, soa.refresh, soa.retry, soa.expire, soa.minimum)
    )
    return Section(1, _rr(encode_name(owner, suffixes), SOA, ttl, rdata))


def txt_records(owner: bytes, values: list[tuple[bytes, int]], suffixes: dict[bytes, int]) -> Section:
    """TXT records for ``owner``: each (rdata as received, TTL)."""
    encoded_owner = encode_name(owner, suffixes)
    return Section(len(values), b"".join(_rr(encoded_owner, TXT, ttl, rdata) for rdata, ttl in values))


def rfc8482_hinfo(owner: bytes, ttl: int, suffixes: dict[bytes, int]) -> Section:
    """The synthesized answer to ANY of RFC 8482 §4.2: HINFO "RFC8482" ""."""
    rdata = b"\x07RFC8482\x00"
    return Section(1, _rr(encode_name(owner, suffixes), HINFO, ttl, rdata))
