"""The memo of rendered responses of one table generation: case-blind, evicted entry by entry.

**Key.** :func:`memo_key` is the query after its ID, lower-cased up to the first zero octet
after the header (the end of the question name), the rest as is. So everything else —
qtype, qclass, the whole OPT record (version, DO, payload size, ECS family/prefix/address,
any other option) — is part of the key byte for byte, and two queries share an entry only
if they differ in the ID, the case of the name's letters and the AD bit, none of which
changes the response but for the echoed question. That is finer than necessary (two
resolvers advertising 1232 and 4096 keep two entries) and costs a ``find``, a ``lower`` and
a concatenation, no parse — none of which a query without an upper-case octet needs: ``lower``
would change nothing, so its bytes after the ID are already its key (``bytes.islower``, one
scan; the UDP hitter takes that way). Each transport has its own memo (``ZoneTables.response_memo``,
``tcp_response_memo``).

Why folding is exact for the queries :func:`memoisable` admits (one question, no answer or
authority records, at most one additional record, opcode QUERY): in the header, ``lower``
leaves byte 2 (below 0x08) and the counts (0 or 1) alone and can only set AD (0x20) in
byte 3, which the response does not copy. In the name, label lengths (≤ 63) are left alone
and only the ASCII case of label octets changes; DNS compares names case-blind (RFC 4343)
and the answer path looks names up lower-cased. A label holding a zero octet only ends the
folded part early, which makes the key more specific, never less.

**Value.** An :class:`Entry` holds the response without ID and question: the ten header bytes
after the ID and the bytes after the question. A hit splices the query's own ID and question
(its case, for 0x20 resolvers) in between — ``query[:2] + head + query[12:qend] + tail`` — so
the response is byte-identical to rendering. The UDP listener's hitter writes ``head`` and ``tail``
over the query in its receive buffer instead: the same bytes, without a join or a copy.

**Eviction.** Two pools. A new entry waits in ``probation`` (FIFO, a quarter of the size); a
second query for it before it falls out promotes it to ``main``, where a hit only sets a bit.
When ``main`` is full the oldest entry goes, unless its bit is set: then it is cleared and the
entry moves to the back (CLOCK / second chance). A flood of one-off queries only churns
probation, so it cannot evict what is hot. NXDOMAIN and REFUSED answers (random names) are not
memoised at all (see ``Responder``).
"""

from __future__ import annotations


class Entry:
    __slots__ = ("counted", "head", "hot", "limit_class", "name", "qend", "qtype", "tail")

    def __init__(self, response: bytes, qlen: int, qtype: int, rcode: int, name: bytes, limit_class: int = 0) -> None:
        self.head = response[2:12]  # flags and counts
        self.qend = 12 + qlen  # where the question (name, type, class) ends
        self.tail = response[self.qend:]  # everything after the question
        self.qtype = qtype
        self.counted = (qtype, rcode)  # the DnsCounters.answers key
        self.name = name  # lower-cased qname, for rate limiting
        self.limit_class = limit_class  # its region_agent.globaldns.rrl response class, as the first answer was charged
        self.hot = False


def memo_key(data: bytes) -> bytes:
    """The query after its ID, lower-cased up to the end of the name (``Responder`` inlines it).

    Only for a query that parsed, so its name ends with a zero octet.
    """
    end = data.find(0, 12)
    return data[2:end].lower() + data[end:]


def memoisable(data: bytes) -> bool:
    """Whether a query that parsed may be memoised: at most one additional record (its OPT).

    With more, ``lower`` could fold two different additional counts into one key.
    """
    return data[10] == 0 and data[11] <= 1


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
