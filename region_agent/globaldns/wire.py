"""DNS wire format for an authoritative server: parse queries, render responses.

dnspython costs ~150 µs to parse and answer one message (PLATFORM.md §6.2), so the
answer path speaks the wire format itself: a query is parsed once into a :class:`Query`
and a response is the query's header and question bytes followed by pre-rendered record
bytes. Owner names in those records are compression pointers into the question, which
is copied verbatim, so answers echo the query's case (0x20, cert-manager) for free.

Bad input never raises out of this module except as :class:`MessageError`, which carries
what is needed to answer it (or ``rcode=None``: drop, e.g. a header too short to echo),
including the query's OPT record when that one could be read: every response to a query
with an OPT carries one, error responses included (RFC 6891 §6.1.1).
dnspython stays the reference in the tests, which cross-check both parsers.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Container
from dataclasses import dataclass, field

# Types and classes (RFC 1035 §3.2, RFC 3596, RFC 6891, RFC 8945).
A, NS, SOA, HINFO, TXT, AAAA, OPT, TSIG, IXFR, AXFR, ANY = 1, 2, 6, 13, 16, 28, 41, 250, 251, 252, 255
CLASS_IN = 1

# Opcodes and rcodes (RFC 1035 §4.1.1, RFC 6891 §9 for BADVERS).
OPCODE_QUERY = 0
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED, NOTAUTH = 0, 1, 2, 3, 4, 5, 9
BADVERS = 16

# Header flag bits.
QR = 0x8000
AA = 0x0400
TC = 0x0200
RD = 0x0100
CD = 0x0010
OPCODE_MASK = 0x7800

EDNS_ECS = 8  # RFC 7871 client subnet option code
DO_BIT = 0x8000  # in the OPT TTL's low 16 bits

MIN_UDP_PAYLOAD = 512
_HEADER = struct.Struct("!HHHHHH")
_U16 = struct.Struct("!H")
_RR_FIXED = struct.Struct("!HHIH")  # type, class, ttl, rdlength
_QTAIL = struct.Struct("!HH")  # qtype, qclass


class MessageError(Exception):
    """A message we answer with an error rcode (or drop, when ``rcode`` is None)."""

    def __init__(self, reason: str, rcode: int | None, query_id: int = 0, flags: int = 0,
                 question: bytes = b"", edns: Edns | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.rcode = rcode
        self.query_id = query_id
        self.flags = flags
        self.question = question
        self.edns = edns  # the query's OPT, when it was readable: echoed in the error response


@dataclass(frozen=True, slots=True)
class ClientSubnet:
    """An EDNS Client Subnet option from a query (RFC 7871 §6)."""

    family: int  # 1 IPv4, 2 IPv6, 0 only with source prefix 0
    source_prefix: int
    address: bytes  # as received: ceil(source_prefix / 8) octets

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        """The client network's address (host bits zero), or None when it says nothing.

        A source prefix of 0 means the client asked that its address not be used
        (RFC 7871 §7.1.2), whatever family it names.
        """
        if self.source_prefix == 0:
            return None
        if self.family == 1:
            return ipaddress.IPv4Address(self.address.ljust(4, b"\0"))
        if self.family == 2:
            return ipaddress.IPv6Address(self.address.ljust(16, b"\0"))
        return None

    def option(self, scope_prefix: int) -> bytes:
        """This option as the response carries it: family, source and address echoed."""
        data = struct.pack("!HBB", self.family, self.source_prefix, scope_prefix) + self.address
        return struct.pack("!HH", EDNS_ECS, len(data)) + data


# Edns and Query are built once per query on the answer path: plain slotted dataclasses,
# not frozen ones, whose __init__ goes through object.__setattr__ (~1 µs per query). Treat
# them as immutable all the same.
@dataclass(slots=True)
class Edns:
    payload: int  # requestor's UDP payload size, at least 512
    version: int
    do: bool
    client_subnet: ClientSubnet | None
    # The response OPT records that echo this client subnet, by (our payload, rcode, scope): an Edns
    # is shared by every query with the same OPT bytes (parse_query's memo), so each is built once.
    echoes: dict[tuple[int, int, int], bytes] | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class Query:
    id: int
    flags: int
    qname: bytes  # wire form exactly as received (case kept)
    qname_lower: bytes
    qtype: int
    qclass: int
    edns: Edns | None
    question: bytes  # the question section exactly as received (name, type, class)

    @property
    def text_name(self) -> str:
        return name_to_text(self.qname)


def name_to_text(wire: bytes) -> str:
    labels = []
    i = 0
    while wire[i]:
        n = wire[i]
        labels.append(wire[i + 1:i + 1 + n].decode("ascii", "backslashreplace"))
        i += n + 1
    return ".".join(labels) + "."


def name_from_text(name: str) -> bytes:
    """Lower-case wire form of a presentation-format name (no escapes; ours are LDH)."""
    name = name.rstrip(".").lower()
    out = bytearray()
    if name:
        for label in name.split("."):
            raw = label.encode("ascii")
            if not 0 < len(raw) <= 63:
                raise ValueError(f"bad label {label!r} in {name!r}")
            out.append(len(raw))
            out += raw
    out.append(0)
    if len(out) > 255:
        raise ValueError(f"name {name!r} is longer than 255 octets")
    return bytes(out)


def _skip_name(data: bytes, offset: int) -> int:
    """Skip a possibly compressed name in a non-question section."""
    while True:
        n = data[offset]
        if n == 0:
            return offset + 1
        if n & 0xC0 == 0xC0:
            if offset + 2 > len(data):
                raise ValueError("truncated pointer")
            return offset + 2
        if n & 0xC0:
            raise ValueError("extended label type")
        offset += n + 1


def _answerable(data: bytes, reason: str, rcode: int, query_id: int, flags: int,
                question: bytes = b"") -> MessageError:
    """A :class:`MessageError` to answer, with the query's OPT when one can be read.

    Only on the error path: a second, lenient walk of the message, which the parser skips.
    """
    return MessageError(reason, rcode, query_id, flags, question, find_opt(data))


def find_opt(data: bytes) -> Edns | None:
    """The message's OPT record if exactly one can be read, whatever else is wrong with it.

    Walks every section leniently (compressed names, any counts); None when the walk or the
    OPT itself fails, or when there is more than one OPT (RFC 6891 §6.1.1: then FORMERR
    without one).
    """
    try:
        qdcount, ancount, nscount, arcount = struct.unpack_from("!HHHH", data, 4)
        offset = 12
        for _ in range(qdcount):
            offset = _skip_name(data, offset) + 4
        found: Edns | None = None
        for index in range(ancount + nscount + arcount):
            owner = offset
            offset = _skip_name(data, offset)
            rtype, rclass, ttl, rdlen = _RR_FIXED.unpack_from(data, offset)
            offset += 10
            if offset + rdlen > len(data):
                return None
            if rtype == OPT and index >= ancount + nscount:
                if found is not None or data[owner] != 0:
                    return None
                found = _parse_opt(data, offset, offset + rdlen, rclass, ttl)
            offset += rdlen
        return found
    except (ValueError, struct.error, IndexError):
        return None


OPT_MEMO_BYTES = 64  # OPT records up to this size (a plain OPT is 11 octets, one with an IPv6 /56 ECS 26) are memoised
OPT_MEMO_ENTRIES = 4096  # distinct ones kept; when full it starts again (a flood of subnets costs a parse each)
_OPT_MEMO: dict[bytes, Edns] = {}  # a query's closing OPT record, byte for byte → what it parsed to


def parse_query(data: bytes, known: Container[bytes] = ()) -> Query:
    """Parse a query, or raise :class:`MessageError` saying how to answer it.

    The common shape (one question, then nothing or one OPT record) takes the short way: an OPT
    record seen before is looked up by its bytes instead of parsed again (resolvers send the
    same few; one with a client subnet repeats per subnet), and a name whose lower-case form is
    in ``known`` (lower-case wire names without zero octets inside labels: the zone's owner
    names) is not walked label by label. That is exact: ``lower`` changes only octets 0x41-0x5A,
    never a label length (at most 63), so the query's labels lie where the known name's do and
    its first zero octet ends it.
    """
    size = len(data)
    if size < 12:
        raise MessageError("short header", None)
    qid, flags, qdcount, ancount, nscount, arcount = _HEADER.unpack_from(data)
    if flags & QR:
        raise MessageError("a response, not a query", None)  # never answer answers
    if qdcount != 1:
        opcode_ok = (flags & OPCODE_MASK) >> 11 == OPCODE_QUERY
        raise _answerable(data, f"{qdcount} questions", FORMERR if opcode_ok else NOTIMP, qid, flags)
    qend = data.find(0, 12) + 1
    qname_lower = data[12:qend].lower() if qend else b""
    if qname_lower not in known:
        found, qend = qend, _walk_name(data, qid, flags)
        if qend != found:  # a zero octet inside a label: the name goes on past it
            qname_lower = b""
    offset = qend + 4
    if offset > size:
        raise _answerable(data, "truncated question", FORMERR, qid, flags)
    qtype, qclass = _QTAIL.unpack_from(data, qend)
    question = data[12:offset]
    if flags & OPCODE_MASK:
        opcode = (flags & OPCODE_MASK) >> 11
        raise _answerable(data, f"opcode {opcode} not implemented", NOTIMP, qid, flags, question)
    # An IXFR query carries the client's SOA in its authority section (RFC 1995 §3): read past
    # it, so that IXFR gets the same REFUSED as AXFR rather than FORMERR.
    if ancount or (nscount and qtype != IXFR):
        raise _answerable(data, "records in the answer or authority section of a query", FORMERR, qid, flags, question)
    edns: Edns | None = None
    if arcount == 1 and not nscount and size - offset <= OPT_MEMO_BYTES:
        opt = data[offset:]
        edns = _OPT_MEMO.get(opt)
        if edns is None:
            edns = _additional(data, offset, 0, 1, qid, flags, question)
            if edns is not None:  # it was a well-formed OPT, and all that followed the question
                if len(_OPT_MEMO) >= OPT_MEMO_ENTRIES:
                    _OPT_MEMO.clear()
                _OPT_MEMO[opt] = edns
    elif nscount or arcount:
        edns = _additional(data, offset, nscount, arcount, qid, flags, question)
    elif offset != size:
        raise _answerable(data, "trailing bytes after the message", FORMERR, qid, flags, question)
    qname = data[12:qend]
    return Query(qid, flags, qname, qname_lower or qname.lower(), qtype, qclass, edns, question)


def _walk_name(data: bytes, qid: int, flags: int) -> int:
    """Where the question name that starts at offset 12 ends (after its zero octet); FORMERR if malformed."""
    qend = 12
    try:
        n = data[12]
        while n:
            if n > 63:  # a compression pointer or an extended label type: neither belongs in a question
                raise _answerable(data, "malformed question name", FORMERR, qid, flags)
            qend += n + 1
            if qend > 266:  # 255 octets with the zero one (RFC 1035 §3.1), from offset 12
                raise _answerable(data, "malformed question name", FORMERR, qid, flags)
            n = data[qend]
    except IndexError:
        raise _answerable(data, "malformed question name", FORMERR, qid, flags) from None
    return qend + 1


def _additional(data: bytes, offset: int, nscount: int, arcount: int, qid: int, flags: int,
                question: bytes) -> Edns | None:
    """The records after the question (an IXFR's SOA, the OPT): the query's OPT, if it has one."""
    edns: Edns | None = None
    try:
        for index in range(nscount + arcount):
            owner = offset
            offset = _skip_name(data, offset)
            rtype, rclass, ttl, rdlen = _RR_FIXED.unpack_from(data, offset)
            offset += 10
            rdata_end = offset + rdlen
            if rdata_end > len(data):
                raise ValueError("record data runs past the message")
            if index < nscount:
                pass  # the IXFR's SOA: not looked at
            elif rtype == OPT:
                if edns is not None:
                    raise ValueError("more than one OPT record")
                if data[owner] != 0:
                    raise ValueError("OPT owner is not the root")
                edns = _parse_opt(data, offset, rdata_end, rclass, ttl)
            elif rtype == TSIG:
                raise _answerable(data, "TSIG-signed queries are not served", NOTAUTH, qid, flags, question)
            offset = rdata_end
    except (ValueError, struct.error, IndexError) as exc:
        raise _answerable(data, f"malformed additional section: {exc}", FORMERR, qid, flags, question) from None
    if offset != len(data):
        raise _answerable(data, "trailing bytes after the message", FORMERR, qid, flags, question)
    return edns


def _parse_opt(data: bytes, offset: int, end: int, payload: int, ttl: int) -> Edns:
    version = (ttl >> 16) & 0xFF
    client_subnet: ClientSubnet | None = None
    while offset < end:
        if offset + 4 > end:
            raise ValueError("truncated EDNS option")
        code, length = struct.unpack_from("!HH", data, offset)
        offset += 4
        if offset + length > end:
            raise ValueError("EDNS option runs past the OPT record")
        if code == EDNS_ECS:
            if client_subnet is not None:
                raise ValueError("more than one client subnet option")
            client_subnet = _parse_ecs(data[offset:offset + length])
        offset += length
    return Edns(max(payload, MIN_UDP_PAYLOAD), version, bool(ttl & DO_BIT), client_subnet)


def _parse_ecs(option: bytes) -> ClientSubnet:
    if len(option) < 4:
        raise ValueError("client subnet option shorter than 4 octets")
    family, source, scope = struct.unpack_from("!HBB", option)
    address = option[4:]
    if family == 1:
        width = 32
    elif family == 2:
        width = 128
    elif family == 0 and source == 0 and not address:
        width = 0  # RFC 7871 §7.1.2: the client asked that no address be used
    else:
        raise ValueError(f"client subnet family {family} is not supported")
    if source > width:
        raise ValueError("client subnet source prefix longer than the address")
    if scope != 0:
        raise ValueError("client subnet scope prefix must be 0 in a query")
    if len(address) != (source + 7) // 8:
        raise ValueError("client subnet address length does not match its prefix")
    if source % 8 and address[-1] & (0xFF >> (source % 8)):
        raise ValueError("client subnet address has bits set beyond its prefix")
    return ClientSubnet(family, source, address)


def opt_record(our_payload: int, *, extended_rcode: int = 0, do: bool = False, options: bytes = b"") -> bytes:
    ttl = ((extended_rcode >> 4) << 24) | (DO_BIT if do else 0)
    return b"\x00" + _RR_FIXED.pack(OPT, our_payload, ttl, len(options)) + options


def response_flags(query_flags: int, *, rcode: int, aa: bool) -> int:
    """QR set, opcode/RD/CD copied from the query, AA when we are authoritative."""
    flags = QR | (query_flags & (OPCODE_MASK | RD | CD)) | (rcode & 0xF)
    return flags | AA if aa else flags


def error_response(error: MessageError, *, our_payload: int) -> bytes | None:
    """Answer for a message that :func:`parse_query` refused, or None to drop it."""
    if error.rcode is None:
        return None
    flags = response_flags(error.flags, rcode=error.rcode, aa=False)
    qdcount = 1 if error.question else 0
    opt = b""
    if error.edns is not None:
        subnet = error.edns.client_subnet
        opt = opt_record(our_payload, extended_rcode=error.rcode, do=error.edns.do,
                         options=b"" if subnet is None else subnet.option(0))
    return _HEADER.pack(error.query_id, flags, qdcount, 0, 0, 1 if opt else 0) + error.question + opt


def header(query_id: int, flags: int, qd: int, an: int, ns: int, ar: int) -> bytes:
    return _HEADER.pack(query_id, flags, qd, an, ns, ar)
