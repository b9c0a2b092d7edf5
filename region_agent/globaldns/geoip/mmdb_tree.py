"""The search tree of a MaxMind DB file, and the location of its data records.

The MaxMind DB format (https://maxmind.github.io/MaxMind-DB/) is a binary trie over the
address bits followed by a data section and a metadata map:

* Node ``k`` holds two records, for address bit 0 (left) and bit 1 (right), each 24, 28 or 32
  bits wide. A record value ``v`` means: ``v < node_count`` — go to node ``v``;
  ``v == node_count`` — no data for this network; ``v > node_count`` — a data record at
  ``v - node_count - 16`` bytes into the data section. The record value reached by the walk
  therefore *is* the identity of the answer: equal values mean equal data.
* An IPv6 tree holds IPv4 at ``::/96``, and MaxMind's writers point other networks at that same
  node (IPv4-mapped ``::ffff:0:0/96``, 6to4 ``2002::/16``), so the "tree" is a DAG: every
  property of a node's subtree computed here is a function of the node alone, never of the path
  that reached it.

:class:`SearchTree` checks the file once when it is opened (metadata via the ``maxminddb``
reader, record size, tree bounds, the 16-byte separator, record values pointing inside the data
section) and copies the two records of every node into two ``array('I')`` so that a walk costs
an index per bit instead of an ``int.from_bytes`` of a slice (about 2 µs for a 24-bit walk in
CPython instead of 5 µs; 8 bytes per node, 29 MB for GeoLite2-City 2018's 3.6 M nodes).

The data section stays memory-mapped. :meth:`SearchTree.location` reads only
``location.latitude`` / ``location.longitude`` of a record: it walks the top-level map, skips
every other value without building it (a skipped pointer costs O(1)), and never raises on a
corrupt record — it answers ``None`` and counts it in ``corrupt_records``, because a DNS answer
path must not fail on one bad record of a file that opened cleanly.

Nothing here copies MaxMind's or gdnsd's code; it follows the published format specification.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import sys
from array import array
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

import maxminddb

__all__ = ["GeoDatabaseError", "Metadata", "SearchTree"]

_METADATA_MARKER = b"\xab\xcd\xefMaxMind.com"
_METADATA_SEARCH_WINDOW = 128 * 1024
_SEPARATOR = bytes(16)
_MAX_SKIP_DEPTH = 32
_MAX_SKIP_ITEMS = 4096
_MAPPED_PREFIX = 0xFFFF  # ::ffff:0:0/96 >> 32

_T_POINTER = 1
_T_UTF8 = 2
_T_DOUBLE = 3
_T_BYTES = 4
_T_MAP = 7
_T_ARRAY = 11
_T_BOOLEAN = 14
_T_FLOAT = 15
# uint16, uint32, int32, uint64, uint128: payload is `size` bytes
_FIXED_OR_VARIABLE_INT = frozenset({5, 6, 8, 9, 10})
_SHORT_SCALARS = frozenset({_T_UTF8, _T_BYTES, 5, 6, 8, 9, 10})  # payload = size bytes
_MAX_CACHED_KEYS = 4096
_MAX_CACHED_PLACES = 1 << 12
_MISSING = object()
_DOUBLE_CTRL = (_T_DOUBLE << 5) | 8
_DOUBLE = struct.Struct(">d")
_POINTER_ADD = (0, 2048, 526336, 0)

_KEY_LOCATION = b"location"
_KEY_LATITUDE = b"latitude"
_KEY_LONGITUDE = b"longitude"
_KEYS_COORDINATES = (_KEY_LATITUDE, _KEY_LONGITUDE)


class GeoDatabaseError(Exception):
    """The GeoIP database file cannot be used; the message names the file and the reason."""


class _CorruptRecordError(Exception):
    """A data record that does not decode (internal: turned into "no location")."""


@dataclass(frozen=True, slots=True)
class Metadata:
    database_type: str
    ip_version: int
    record_size: int
    node_count: int
    build_epoch: int


def is_ipv4_mapped(value: int) -> bool:
    """Whether a 128-bit integer is an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``)."""
    return value >> 32 == _MAPPED_PREFIX


class SearchTree:
    """A MaxMind DB search tree in memory, its data section mapped from the file.

    ``left[k]`` / ``right[k]`` are the record values of node ``k``. ``ipv4_root`` is the record
    value that stands for the whole IPv4 space (node ``0`` in an IPv4 tree; the value reached after
    96 zero bits in an IPv6 tree, which may already be a leaf). ``mapped_aliased`` says whether
    ``::ffff:0:0/96`` reaches that same value, i.e. whether the file itself maps IPv4-mapped
    addresses to the IPv4 data.
    """

    __slots__ = (
        "_data_end",
        "_data_start",
        "_keys",
        "_mm",
        "_places",
        "corrupt_records",
        "ipv4_root",
        "left",
        "mapped_aliased",
        "metadata",
        "node_count",
        "path",
        "right",
    )

    def __init__(self, path: str, mm: mmap.mmap, metadata: Metadata, data_end: int) -> None:
        self.path = path
        self._mm = mm
        self.metadata = metadata
        self.node_count = metadata.node_count
        tree_size = metadata.node_count * metadata.record_size // 4
        self._data_start = tree_size + len(_SEPARATOR)
        self._data_end = data_end
        self.corrupt_records = 0
        self._keys: dict[int, bytes] = {}
        self._places: dict[int, tuple[float, float] | None] = {}
        self.left, self.right = _split_records(mm, metadata.node_count, metadata.record_size)
        # The tree is read from the arrays from now on: let the kernel drop its mapped pages.
        page = mmap.PAGESIZE
        if hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED") and tree_size >= page:
            mm.madvise(mmap.MADV_DONTNEED, 0, tree_size - tree_size % page)
        n = self.node_count
        highest = max(max(self.left, default=0), max(self.right, default=0))
        if highest > n and highest - n + tree_size >= data_end:
            raise GeoDatabaseError(
                f"GeoIP database {path}: the search tree points past the data section "
                f"(record {highest}, {data_end - self._data_start} bytes of data)"
            )
        if metadata.ip_version == 4:
            self.ipv4_root = 0
            self.mapped_aliased = False
        else:
            self.ipv4_root = self._descend(0, 96)
            self.mapped_aliased = self._descend(_MAPPED_PREFIX << 32, 96) == self.ipv4_root

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SearchTree:
        name = os.fspath(path)
        try:
            reader = maxminddb.open_database(name, maxminddb.MODE_MMAP)
        except FileNotFoundError as exc:
            raise GeoDatabaseError(f"GeoIP database {name}: file not found") from exc
        except (OSError, ValueError, TypeError, RuntimeError, struct.error, IndexError) as exc:
            # maxminddb raises InvalidDatabaseError (a RuntimeError) for a bad file, ValueError
            # for an empty one (mmap), TypeError for metadata with missing or unknown keys.
            raise GeoDatabaseError(f"GeoIP database {name}: not a valid MaxMind DB file ({exc})") from exc
        try:
            meta = reader.metadata()
            metadata = Metadata(
                database_type=str(meta.database_type),
                ip_version=int(meta.ip_version),
                record_size=int(meta.record_size),
                node_count=int(meta.node_count),
                build_epoch=int(meta.build_epoch),
            )
        finally:
            reader.close()
        if metadata.ip_version not in (4, 6):
            raise GeoDatabaseError(f"GeoIP database {name}: unknown ip_version {metadata.ip_version}")
        if metadata.record_size not in (24, 28, 32):
            raise GeoDatabaseError(f"GeoIP database {name}: unknown record_size {metadata.record_size}")
        if metadata.node_count <= 0:
            raise GeoDatabaseError(f"GeoIP database {name}: empty search tree")
        try:
            with open(name, "rb") as handle:
                mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GeoDatabaseError(f"GeoIP database {name}: cannot map the file ({exc})") from exc
        try:
            size = len(mm)
            marker = mm.rfind(_METADATA_MARKER, max(0, size - _METADATA_SEARCH_WINDOW))
            tree_size = metadata.node_count * metadata.record_size // 4
            if marker < 0 or tree_size + len(_SEPARATOR) > marker:
                raise GeoDatabaseError(f"GeoIP database {name}: the search tree overlaps the metadata")
            if mm[tree_size : tree_size + len(_SEPARATOR)] != _SEPARATOR:
                raise GeoDatabaseError(
                    f"GeoIP database {name}: no data section separator after the search tree "
                    "(wrong node_count or record_size in the metadata?)"
                )
            return cls(name, mm, metadata, marker)
        except BaseException:
            mm.close()
            raise

    def close(self) -> None:
        self._mm.close()

    # -- the tree -----------------------------------------------------------------------------

    def _descend(self, value: int, bits: int) -> int:
        """The record value reached from the root by the first ``bits`` bits of a 128-bit value."""
        node = 0
        n = self.node_count
        for i in range(bits):
            if node >= n:
                break
            node = self.right[node] if (value >> (127 - i)) & 1 else self.left[node]
        return node

    def start(self, version: int) -> tuple[int, int] | None:
        """(record value where a walk starts, address width) for a family, or None if absent."""
        if version == 4:
            return self.ipv4_root, 32
        if self.metadata.ip_version == 6:
            return 0, 128
        return None

    def lookup(self, address: IPv4Address | IPv6Address) -> tuple[int, int]:
        """(record value, prefix length) of the network holding ``address``.

        IPv4-mapped IPv6 addresses are looked up as IPv4 (prefix length in IPv6 bits). A record
        value equal to ``node_count`` means no data. A walk that does not end within the address
        width (only in a corrupt tree) answers no data at full length.
        """
        value = int(address)
        offset = 0
        if address.version == 6 and is_ipv4_mapped(value):
            value &= 0xFFFFFFFF
            version = 4
            offset = 96
        else:
            version = address.version
        begin = self.start(version)
        if begin is None:
            return self.node_count, 0
        node, bits = begin
        n = self.node_count
        left = self.left
        right = self.right
        depth = 0
        while node < n:
            if depth == bits:
                return n, bits + offset
            node = right[node] if (value >> (bits - 1 - depth)) & 1 else left[node]
            depth += 1
        return node, depth + offset

    # -- the data section ---------------------------------------------------------------------

    def location(self, record: int) -> tuple[float, float] | None:
        """``(latitude, longitude)`` of the data record a leaf value points to, else None.

        None for the empty value, for a record without ``location.latitude``/``longitude``, for
        coordinates outside [-90, 90] x [-180, 180] or not finite, and for a record that does
        not decode (also counted in ``corrupt_records``).
        """
        if record <= self.node_count:
            return None
        offset = record - self.node_count - len(_SEPARATOR) + self._data_start
        try:
            return self._location_at(offset)
        except (_CorruptRecordError, IndexError, struct.error):
            self.corrupt_records += 1
            return None

    def _check(self, offset: int) -> None:
        if not self._data_start <= offset < self._data_end:
            raise _CorruptRecordError(offset)

    def _control(self, offset: int) -> tuple[int, int, int]:
        """(type, size or pointer bits, payload offset) of the value at ``offset``."""
        self._check(offset)
        mm = self._mm
        ctrl = mm[offset]
        offset += 1
        kind = ctrl >> 5
        if kind == 0:
            self._check(offset)
            kind = 7 + mm[offset]
            offset += 1
            if kind < 8:
                raise _CorruptRecordError(offset)
        size = ctrl & 0x1F
        if kind == _T_POINTER:
            return kind, size, offset
        if size == 29:
            self._check(offset)
            size = 29 + mm[offset]
            offset += 1
        elif size == 30:
            self._check(offset + 1)
            size = 285 + int.from_bytes(mm[offset : offset + 2], "big")
            offset += 2
        elif size == 31:
            self._check(offset + 2)
            size = 65821 + int.from_bytes(mm[offset : offset + 3], "big")
            offset += 3
        return kind, size, offset

    def _pointer(self, bits: int, offset: int) -> tuple[int, int]:
        """(target offset, offset after the pointer) of a pointer whose control bits are ``bits``."""
        length = ((bits >> 3) & 3) + 1
        if length == 1:
            target = self._data_start + (((bits & 7) << 8) | self._mm[offset])
        else:
            raw = int.from_bytes(self._mm[offset : offset + length], "big")
            if length < 4:
                raw |= (bits & 7) << (8 * length)
            target = self._data_start + raw + _POINTER_ADD[length - 1]
        if target >= self._data_end or offset + length > self._data_end:
            raise _CorruptRecordError(offset)
        return target, offset + length

    def _resolve(self, offset: int) -> tuple[int, int, int]:
        """Like :meth:`_control`, following one pointer (pointers to pointers are invalid)."""
        kind, size, payload = self._control(offset)
        if kind == _T_POINTER:
            target, _ = self._pointer(size, payload)
            kind, size, payload = self._control(target)
            if kind == _T_POINTER:
                raise _CorruptRecordError(offset)
        return kind, size, payload

    def _skip(self, offset: int, depth: int = 0) -> int:
        """The offset just after the value at ``offset``, without decoding it."""
        kind, size, payload = self._control(offset)
        if kind == _T_POINTER:
            return self._pointer(size, payload)[1]
        if kind in (_T_UTF8, _T_BYTES) or kind in _FIXED_OR_VARIABLE_INT:
            if kind in _FIXED_OR_VARIABLE_INT and size > 16:
                raise _CorruptRecordError(offset)
            end = payload + size
        elif kind == _T_DOUBLE:
            if size != 8:
                raise _CorruptRecordError(offset)
            end = payload + 8
        elif kind == _T_FLOAT:
            if size != 4:
                raise _CorruptRecordError(offset)
            end = payload + 4
        elif kind == _T_BOOLEAN:
            return payload
        elif kind in (_T_MAP, _T_ARRAY):
            if depth >= _MAX_SKIP_DEPTH:
                raise _CorruptRecordError(offset)
            items = size * 2 if kind == _T_MAP else size
            if items > _MAX_SKIP_ITEMS:
                raise _CorruptRecordError(offset)
            end = payload
            for _ in range(items):
                end = self._skip(end, depth + 1)
            return end
        else:
            raise _CorruptRecordError(offset)
        if end > self._data_end:
            raise _CorruptRecordError(offset)
        return end

    def _key(self, offset: int) -> tuple[bytes, int]:
        """(raw UTF-8 bytes of the map key at ``offset``, offset after the key)."""
        mm = self._mm
        ctrl = mm[offset]
        if ctrl & 0xF8 == 0x20:  # a pointer in its 2-byte form: keys written first are near 0
            target = self._data_start + (((ctrl & 7) << 8) | mm[offset + 1])
            after = offset + 2
        elif ctrl >> 5 == _T_POINTER:
            target, after = self._pointer(ctrl & 0x1F, offset + 1)
        else:
            kind, size, payload = self._control(offset)
            if kind != _T_UTF8 or payload + size > self._data_end:
                raise _CorruptRecordError(offset)
            return mm[payload : payload + size], payload + size
        key = self._keys.get(target)
        if key is None:
            key = self._string(target)
            if len(self._keys) >= _MAX_CACHED_KEYS:
                self._keys.clear()
            self._keys[target] = key
        return key, after

    def _string(self, offset: int) -> bytes:
        kind, size, payload = self._control(offset)
        if kind != _T_UTF8 or payload + size > self._data_end:
            raise _CorruptRecordError(offset)
        return self._mm[payload : payload + size]

    def _number(self, offset: int) -> float | None:
        kind, size, payload = self._resolve(offset)
        if kind == _T_DOUBLE and size == 8:
            self._check(payload + 7)
            return float(struct.unpack_from(">d", self._mm, payload)[0])
        if kind == _T_FLOAT and size == 4:
            self._check(payload + 3)
            return float(struct.unpack_from(">f", self._mm, payload)[0])
        return None

    def _next(self, offset: int) -> int:
        """The offset after the value at ``offset``: the common short forms inline, else _skip."""
        ctrl = self._mm[offset]
        kind = ctrl >> 5
        if kind == _T_POINTER:
            return offset + 2 + ((ctrl >> 3) & 3)
        if kind in _SHORT_SCALARS and ctrl & 0x1F < 29:
            return offset + 1 + (ctrl & 0x1F)
        if ctrl == _DOUBLE_CTRL:
            return offset + 9
        return self._skip(offset)

    def _location_at(self, offset: int) -> tuple[float, float] | None:
        kind, entries, cursor = self._resolve(offset)
        if kind != _T_MAP or entries > _MAX_SKIP_ITEMS:
            raise _CorruptRecordError(offset)
        end = self._data_end
        for _ in range(entries):
            key, cursor = self._key(cursor)
            if cursor >= end:
                raise _CorruptRecordError(cursor)
            if key != _KEY_LOCATION:
                cursor = self._next(cursor)
                continue
            ctrl = self._mm[cursor]
            if ctrl >> 5 != _T_POINTER:
                return self._coordinates(cursor)
            # records of one place may share their location map: decode each shared map once
            target = self._pointer(ctrl & 0x1F, cursor + 1)[0]
            found = self._places.get(target, _MISSING)
            if found is _MISSING:
                found = self._coordinates(target)
                if len(self._places) >= _MAX_CACHED_PLACES:
                    self._places.clear()
                self._places[target] = found
            return found  # type: ignore[return-value]
        return None

    def _coordinates(self, offset: int) -> tuple[float, float] | None:
        kind, entries, cursor = self._resolve(offset)
        if kind != _T_MAP or entries > _MAX_SKIP_ITEMS:
            raise _CorruptRecordError(offset)
        mm = self._mm
        end = self._data_end
        latitude: float | None = None
        longitude: float | None = None
        for _ in range(entries):
            name, cursor = self._key(cursor)
            if name in _KEYS_COORDINATES:
                if mm[cursor] == _DOUBLE_CTRL and cursor + 9 <= end:
                    number: float | None = _DOUBLE.unpack_from(mm, cursor + 1)[0]
                    cursor += 9
                else:
                    number = self._number(cursor)
                    cursor = self._skip(cursor)
                if name == _KEY_LATITUDE:
                    latitude = number
                else:
                    longitude = number
            else:
                cursor = self._next(cursor)
        if cursor > end:
            raise _CorruptRecordError(cursor)
        if latitude is None or longitude is None:
            return None
        if not (math.isfinite(latitude) and math.isfinite(longitude)):
            return None
        if abs(latitude) > 90.0 or abs(longitude) > 180.0:
            return None
        return latitude, longitude


def _split_records(mm: mmap.mmap, node_count: int, record_size: int) -> tuple[array[int], array[int]]:
    """Both records of every node as two arrays of unsigned 32-bit ints (C-speed byte shuffles)."""
    node_bytes = record_size // 4
    raw = mm[: node_count * node_bytes]
    left = bytearray(4 * node_count)
    right = bytearray(4 * node_count)
    if record_size == 24:
        for i in range(3):
            left[1 + i :: 4] = raw[i::6]
            right[1 + i :: 4] = raw[3 + i :: 6]
    elif record_size == 32:
        for i in range(4):
            left[i::4] = raw[i::8]
            right[i::4] = raw[4 + i :: 8]
    else:  # 28: the middle byte's high nibble tops the left record, its low nibble the right one
        middle = raw[3::7]
        left[0::4] = middle.translate(_HIGH_NIBBLE)
        right[0::4] = middle.translate(_LOW_NIBBLE)
        for i in range(3):
            left[1 + i :: 4] = raw[i::7]
            right[1 + i :: 4] = raw[4 + i :: 7]
    out_left = array("I")
    out_right = array("I")
    if out_left.itemsize != 4:  # pragma: no cover - every supported CPython platform has 4
        raise GeoDatabaseError("array('I') is not 32 bits on this platform")
    out_left.frombytes(left)
    out_right.frombytes(right)
    if sys.byteorder == "little":
        out_left.byteswap()
        out_right.byteswap()
    return out_left, out_right


_HIGH_NIBBLE = bytes(b >> 4 for b in range(256))
_LOW_NIBBLE = bytes(b & 0x0F for b in range(256))
