"""The replay cache: a signed message (UPDATE or QUERY) is taken once.

A captured signed UPDATE verifies for as long as its time is within the fudge of the server's
clock (300 s either way), so replaying it put an old challenge back, or deleted a live one. Every
message that verifies is remembered by (key name, MAC) until its time is out of the window for
good (time signed + :data:`~region_agent.globaldns.acme.tsig.FUDGE` + a margin); a second copy
within that time is a replay.

Bounded: at most ``capacity`` entries (about 200 bytes each). The budgets let one key make at
most ``rate`` × 630 s of them; when the cache is full a new message is refused rather than an
entry dropped early, since a dropped entry could be replayed.

The cache is this agent's: a message replayed to another agent is not seen here.
"""

from __future__ import annotations

import enum
import heapq
import time
from collections.abc import Callable

from region_agent.globaldns.acme.tsig import FUDGE

MARGIN = 30.0  # seconds past the window: the clock may step while an entry waits
CAPACITY = 16_384


class Seen(enum.Enum):
    FRESH = "fresh"
    REPLAY = "replay"
    FULL = "full"


class ReplayCache:
    def __init__(self, *, capacity: int = CAPACITY, margin: float = MARGIN,
                 clock: Callable[[], float] = time.time) -> None:
        self.capacity = capacity
        self.margin = margin
        self._clock = clock  # the TSIG time check's clock: an entry lives as long as its message verifies
        self._expiry: dict[tuple[str, bytes], float] = {}
        self._heap: list[tuple[float, tuple[str, bytes]]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def check(self, keyname: str, mac: bytes, time_signed: int) -> Seen:
        """Remember the message, or say it is a replay (or that there is no room to remember it)."""
        self._expire(self._clock())
        entry = (keyname.lower(), mac)
        if entry in self._expiry:
            return Seen.REPLAY
        if len(self._expiry) >= self.capacity:
            return Seen.FULL
        expires = time_signed + FUDGE + self.margin
        self._expiry[entry] = expires
        heapq.heappush(self._heap, (expires, entry))
        return Seen.FRESH

    def _expire(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, entry = heapq.heappop(heap)
            del self._expiry[entry]
