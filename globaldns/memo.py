"""The memo of rendered responses of one table generation: case-blind, evicted entry by entry.

**Key.** :func:`memo_key` is the query after its ID with the question *name* lower-cased, plus
the transport. Everything else in the message — flags, counts, qtype, qclass, the whole OPT
record (version, DO, payload size, ECS family/prefix/address, any other option) — is part of
the key byte for byte, so two queries share an entry only if they differ in the ID and the
case of the name's letters, which changes nothing in the answer but the echoed question.
That is finer than necessary (two resolvers advertising 1232 and 4096 keep two entries) and
costs one ``find``, one ``lower`` and two concatenations, no parse.

Why folding is exact: the name's first zero octet is found with ``find``; bytes up to it are
label lengths (≤ 63, which ``lower`` leaves alone) and label octets, whose ASCII case is all
``lower`` changes; DNS compares names case-blind (RFC 4343) and the answer path looks names
up lower-cased. A label holding a zero octet only ends the folded part early, which makes the
key more specific, never less.

**Value.** An :class:`Entry` holds the response without ID and question: the ten header bytes
after the ID and the bytes after the question. A hit splices the query's own ID and question
(its case, for 0x20 resolvers) in between, so the response is byte-identical to rendering.

**Eviction.** Two pools. A new entry waits in ``probation`` (FIFO, a quarter of the size); a
second query for it before it falls out promotes it to ``main``, where a hit only sets a bit.
When ``main`` is full the oldest entry goes, unless its bit is set: then it is cleared and the
entry moves to the back (CLOCK / second chance). A flood of one-off queries only churns
probation, so it cannot evict what is hot. NXDOMAIN and REFUSED answers (random names) are not
memoised at all (see ``Responder``).
"""

from __future__ import annotations

TCP_SUFFIX, UDP_SUFFIX = b"T", b"U"


class Entry:
    __slots__ = ("head", "hot", "name", "qlen", "qtype", "rcode", "tail")

    def __init__(self, response: bytes, qlen: int, qtype: int, rcode: int, name: bytes) -> None:
        self.head = response[2:12]  # flags and counts
        self.tail = response[12 + qlen:]  # everything after the question
        self.qlen = qlen  # question length: name, type, class
        self.qtype = qtype
        self.rcode = rcode
        self.name = name  # lower-cased qname, for rate limiting
        self.hot = False

    def response(self, query: bytes) -> bytes:
        return query[:2] + self.head + query[12:12 + self.qlen] + self.tail


def memo_key(data: bytes, tcp: bool) -> bytes:
    """The query after its ID, question name case-folded, and the transport."""
    end = data.find(0, 12)
    if end < 0:
        end = len(data)
    return data[2:12] + data[12:end].lower() + data[end:] + (TCP_SUFFIX if tcp else UDP_SUFFIX)


class ResponseMemo:
    def __init__(self, capacity: int) -> None:
        self.probation_capacity = max(1, capacity // 4)
        self.capacity = max(1, capacity - self.probation_capacity)  # of main; both together hold `capacity`
        self.main: dict[bytes, Entry] = {}  # insertion order is the CLOCK hand's order
        self.probation: dict[bytes, Entry] = {}

    def __len__(self) -> int:
        return len(self.main) + len(self.probation)

    def get(self, key: bytes) -> Entry | None:
        """The entry for ``key`` (marked recently used), promoting it out of probation on its second query."""
        entry = self.main.get(key)
        if entry is not None:
            entry.hot = True
            return entry
        return self.promote(key)

    def promote(self, key: bytes) -> Entry | None:
        entry = self.probation.pop(key, None)
        if entry is None:
            return None
        main = self.main
        while len(main) >= self.capacity:
            oldest = next(iter(main))
            victim = main.pop(oldest)
            if victim.hot:  # second chance; each pass clears a bit, so this ends
                victim.hot = False
                main[oldest] = victim
        main[key] = entry
        return entry

    def put(self, key: bytes, entry: Entry) -> None:
        probation = self.probation
        if len(probation) >= self.probation_capacity:
            del probation[next(iter(probation))]
        probation[key] = entry
