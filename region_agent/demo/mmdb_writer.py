"""A small writer of MaxMind DB files, for the demo (its GeoIP database) and the tests (format:
https://maxmind.github.io/MaxMind-DB/).

It builds the binary search tree from inserted networks, a data section and the metadata map,
and packs records of 24, 28 or 32 bits. Proof that what it writes is valid: the ``maxminddb``
reader opens it and answers the inserted records (``tests/globaldns/geoip/test_proximity.py``).

Semantics of :meth:`MmdbWriter.insert`: a later insertion wins over earlier ones for the addresses
it covers (a more specific network inserted after a wider one splits it; a wider one inserted
after replaces it). IPv4 networks in an IPv6 tree live under ``::/96``; with ``alias_ipv4`` (the
default, like MaxMind's databases) ``::ffff:0:0/96`` and ``2002::/16`` point at that same node.

Values: ``str`` → utf8_string, ``float`` → double, ``bool`` → boolean, ``int`` → uint32 (int32
when negative), ``bytes`` → bytes, ``list`` → array, ``dict`` → map; wrap a value in
:class:`Float32`, :class:`UInt16`, :class:`UInt64` or :class:`UInt128` for the other types. With
``pointers=True`` (default) map keys and nested maps are stored once and referred to by pointers,
as MaxMind's writers do, so readers' pointer handling is exercised.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Float32", "MmdbWriter", "UInt16", "UInt64", "UInt128", "city_record"]

METADATA_MARKER = b"\xab\xcd\xefMaxMind.com"


@dataclass(frozen=True)
class Float32:
    value: float


@dataclass(frozen=True)
class UInt16:
    value: int


@dataclass(frozen=True)
class UInt64:
    value: int


@dataclass(frozen=True)
class UInt128:
    value: int


@dataclass(frozen=True)
class _Raw:
    """Bytes written to the data section as they are (to make corrupt records)."""

    data: bytes


def city_record(name: str, latitude: float | None, longitude: float | None, country: str = "ZZ") -> dict[str, object]:
    """A GeoIP2-City-shaped record; ``None`` coordinates are left out."""
    location: dict[str, object] = {"accuracy_radius": UInt16(50), "time_zone": "Etc/UTC"}
    if latitude is not None:
        location["latitude"] = latitude
    if longitude is not None:
        location["longitude"] = longitude
    return {
        "city": {"geoname_id": 1, "names": {"en": name}},
        "continent": {"code": "XX", "names": {"en": "Somewhere"}},
        "country": {"iso_code": country, "names": {"en": country}},
        "location": location,
        "subdivisions": [{"iso_code": "S1", "names": {"en": "Sub"}}],
    }


class _Node:
    __slots__ = ("children",)

    def __init__(self, left: _Child = None, right: _Child = None) -> None:
        self.children: list[_Child] = [left, right]


@dataclass(frozen=True)
class _Leaf:
    key: int  # index into the writer's records


_Child = _Node | _Leaf | None


class MmdbWriter:
    def __init__(
        self,
        *,
        ip_version: int = 6,
        record_size: int = 28,
        database_type: str = "Test-City",
        alias_ipv4: bool = True,
        pointers: bool = True,
        build_epoch: int = 1_700_000_000,
    ) -> None:
        if ip_version not in (4, 6) or record_size not in (24, 28, 32):
            raise ValueError("ip_version must be 4 or 6 and record_size 24, 28 or 32")
        self.ip_version = ip_version
        self.record_size = record_size
        self.database_type = database_type
        self.alias_ipv4 = alias_ipv4
        self.pointers = pointers
        self.build_epoch = build_epoch
        self._bits = 128 if ip_version == 6 else 32
        self._root = _Node()
        self._records: list[object] = []
        self._record_keys: dict[bytes, int] = {}

    # -- the tree ------------------------------------------------------------------------------

    def insert(self, network: str | ipaddress.IPv4Network | ipaddress.IPv6Network, record: object | None) -> None:
        """Map every address of ``network`` to ``record`` (None: no data)."""
        net = ipaddress.ip_network(network) if isinstance(network, str) else network
        value = int(net.network_address)
        length = net.prefixlen
        if net.version == 4:
            if self.ip_version == 6:
                length += 96
        elif self.ip_version == 4:
            raise ValueError(f"{net} does not fit an IPv4 database")
        self._set(value, length, None if record is None else self._leaf(record))

    def insert_raw(self, network: str, data: bytes) -> None:
        """Map a network to raw data-section bytes (for corrupt-record tests)."""
        self.insert(network, _Raw(data))

    def _leaf(self, record: object) -> _Leaf:
        # equal records share one data record, as in MaxMind's files
        key = b"\x00raw" + record.data if isinstance(record, _Raw) else _encode(record, _Section(pointers=False))
        found = self._record_keys.get(key)
        if found is None:
            found = len(self._records)
            self._records.append(record)
            self._record_keys[key] = found
        return _Leaf(found)

    def _set(self, value: int, length: int, child: _Child) -> None:
        bits = self._bits
        if length == 0:
            self._root.children = [child, child]
            return
        node = self._root
        for depth in range(length - 1):
            bit = (value >> (bits - 1 - depth)) & 1
            node = self._split(node, bit)
        node.children[(value >> (bits - length)) & 1] = child

    @staticmethod
    def _split(node: _Node, bit: int) -> _Node:
        """The child node at ``bit``, creating it (copying a leaf or empty into both halves)."""
        child = node.children[bit]
        if isinstance(child, _Node):
            return child
        fresh = _Node(child, child)
        node.children[bit] = fresh
        return fresh

    def _node_at(self, value: int, length: int) -> _Node:
        node = self._root
        for depth in range(length):
            node = self._split(node, (value >> (self._bits - 1 - depth)) & 1)
        return node

    def _alias(self) -> None:
        if self.ip_version != 6 or not self.alias_ipv4:
            return
        ipv4 = self._node_at(0, 96)
        for prefix, length in ((0xFFFF << 32, 96), (0x2002 << 112, 16)):
            parent = self._node_at(prefix, length - 1)
            parent.children[(prefix >> (128 - length)) & 1] = ipv4

    # -- the file ------------------------------------------------------------------------------

    def to_bytes(self, metadata_overrides: Mapping[str, object] | None = None) -> bytes:
        self._alias()
        section = _Section(pointers=self.pointers)
        offsets = [section.add_record(record) for record in self._records]
        nodes: list[_Node] = []
        numbers: dict[int, int] = {}
        queue = [self._root]
        while queue:  # breadth-first numbering of unique nodes (aliases share one)
            following: list[_Node] = []
            for node in queue:
                if id(node) in numbers:
                    continue
                numbers[id(node)] = len(nodes)
                nodes.append(node)
                following.extend(c for c in node.children if isinstance(c, _Node))
            queue = following
        count = len(nodes)

        def value(child: _Child) -> int:
            if child is None:
                return count
            if isinstance(child, _Leaf):
                return count + 16 + offsets[child.key]
            return numbers[id(child)]

        tree = bytearray()
        limit = 1 << self.record_size
        for node in nodes:
            left, right = (value(c) for c in node.children)
            if max(left, right) >= limit:
                raise ValueError(f"record value {max(left, right)} does not fit {self.record_size} bits")
            tree += _pack(left, right, self.record_size)
        metadata: dict[str, object] = {
            "binary_format_major_version": UInt16(2),
            "binary_format_minor_version": UInt16(0),
            "build_epoch": UInt64(self.build_epoch),
            "database_type": self.database_type,
            "description": {"en": "region-agent test database"},
            "ip_version": UInt16(self.ip_version),
            "languages": ["en"],
            "node_count": count,
            "record_size": UInt16(self.record_size),
        }
        if metadata_overrides:
            metadata.update(metadata_overrides)
        return (
            bytes(tree)
            + bytes(16)
            + bytes(section.data)
            + METADATA_MARKER
            + _encode(metadata, _Section(pointers=False))
        )

    def write(self, path: str | os.PathLike[str], metadata_overrides: Mapping[str, object] | None = None) -> None:
        with open(path, "wb") as handle:
            handle.write(self.to_bytes(metadata_overrides))


def _pack(left: int, right: int, record_size: int) -> bytes:
    if record_size == 24:
        return left.to_bytes(3, "big") + right.to_bytes(3, "big")
    if record_size == 32:
        return left.to_bytes(4, "big") + right.to_bytes(4, "big")
    middle = ((left >> 24) << 4) | (right >> 24)
    return (left & 0xFFFFFF).to_bytes(3, "big") + bytes([middle]) + (right & 0xFFFFFF).to_bytes(3, "big")


class _Section:
    """A data section under construction; with ``pointers`` keys and maps are stored once."""

    def __init__(self, *, pointers: bool) -> None:
        self.pointers = pointers
        self.data = bytearray()
        self._interned: dict[bytes, int] = {}

    def intern(self, encoded: bytes) -> int:
        found = self._interned.get(encoded)
        if found is None:
            found = len(self.data)
            self.data += encoded
            self._interned[encoded] = found
        return found

    def add_record(self, record: object) -> int:
        if isinstance(record, _Raw):
            offset = len(self.data)
            self.data += record.data
            return offset
        return self.intern(_encode(record, self))


def _control(kind: int, size: int) -> bytes:
    if size < 29:
        head, extra = size, b""
    elif size < 29 + 256:
        head, extra = 29, bytes([size - 29])
    elif size < 285 + 65536:
        head, extra = 30, (size - 285).to_bytes(2, "big")
    else:
        head, extra = 31, (size - 65821).to_bytes(3, "big")
    if kind < 8:
        return bytes([(kind << 5) | head]) + extra
    return bytes([head, kind - 7]) + extra


def _pointer(offset: int) -> bytes:
    if offset < 2048:
        return bytes([0x20 | (offset >> 8), offset & 0xFF])
    if offset < 526336:
        value = offset - 2048
        return bytes([0x28 | (value >> 16)]) + (value & 0xFFFF).to_bytes(2, "big")
    if offset < 526336 + (1 << 27):
        value = offset - 526336
        return bytes([0x30 | (value >> 24)]) + (value & 0xFFFFFF).to_bytes(3, "big")
    return bytes([0x38]) + offset.to_bytes(4, "big")


def _uint(kind: int, value: int, width: int) -> bytes:
    if not 0 <= value < (1 << (8 * width)):
        raise ValueError(f"{value} does not fit {width} bytes")
    payload = value.to_bytes(width, "big").lstrip(b"\x00")
    return _control(kind, len(payload)) + payload


def _encode(value: object, section: _Section) -> bytes:
    if isinstance(value, bool):
        return _control(14, 1 if value else 0)
    if isinstance(value, str):
        payload = value.encode()
        return _control(2, len(payload)) + payload
    if isinstance(value, float):
        return _control(3, 8) + struct.pack(">d", value)
    if isinstance(value, Float32):
        return _control(15, 4) + struct.pack(">f", value.value)
    if isinstance(value, bytes):
        return _control(4, len(value)) + value
    if isinstance(value, UInt16):
        return _uint(5, value.value, 2)
    if isinstance(value, UInt64):
        return _uint(9, value.value, 8)
    if isinstance(value, UInt128):
        return _uint(10, value.value, 16)
    if isinstance(value, int):
        if value < 0:
            return _control(8, 4) + struct.pack(">i", value)
        return _uint(6, value, 4)
    if isinstance(value, list):
        return _control(11, len(value)) + b"".join(_encode(item, section) for item in value)
    if isinstance(value, Mapping):
        out = bytearray(_control(7, len(value)))
        for key, item in value.items():
            encoded_key = _encode(str(key), section)
            out += _pointer(section.intern(encoded_key)) if section.pointers else encoded_key
            encoded = _encode(item, section)
            if section.pointers and isinstance(item, Mapping):
                out += _pointer(section.intern(encoded))
            else:
                out += encoded
        return bytes(out)
    raise TypeError(f"cannot encode {type(value).__name__}")
