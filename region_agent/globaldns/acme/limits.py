"""UPDATE budgets, charged after the TSIG says who sent the message.

A single budget charged before verification let 200 unsigned UPDATEs a second starve every
signed client. Now:

- messages that do not verify (unsigned, unknown key, bad MAC or time, a replay) share the
  ``unverified`` bucket; past it they get a 12-byte REFUSED without being parsed;
- messages that verify are charged to their key's bucket and their source address's bucket,
  which junk can never reach: it does not verify.

Each bucket holds ``burst`` tokens and refills at ``rate`` a second. The per-key and per-source
tables are bounded (least recently used first out); only senders holding a key make entries.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from region_agent.base.sockets import source_key

MAX_BUCKETS = 1024  # per table; a source evicted starts again with a full bucket, its key's still binds


@dataclass(slots=True)
class Bucket:
    tokens: float
    at: float

    def take(self, now: float, rate: float, burst: float) -> bool:
        self.tokens = min(burst, self.tokens + (now - self.at) * rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class BucketTable:
    """One bucket per name, at most ``capacity`` of them."""

    def __init__(self, rate: float, burst: float, capacity: int = MAX_BUCKETS) -> None:
        self.rate, self.burst, self.capacity = rate, burst, capacity
        self.buckets: OrderedDict[str, Bucket] = OrderedDict()

    def take(self, name: str, now: float) -> bool:
        bucket = self.buckets.get(name)
        if bucket is None:
            bucket = self.buckets[name] = Bucket(self.burst, now)
            if len(self.buckets) > self.capacity:
                self.buckets.popitem(last=False)
        else:
            self.buckets.move_to_end(name)
        return bucket.take(now, self.rate, self.burst)


class UpdateBudgets:
    """The three budgets; each ``take_*`` returns False when that budget is spent."""

    def __init__(self, rate: float, burst: int, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self.unverified = Bucket(float(burst), monotonic())
        self.rate, self.burst = rate, float(burst)
        self.keys = BucketTable(rate, burst)
        self.sources = BucketTable(rate, burst)

    def take_unverified(self) -> bool:
        return self.unverified.take(self._monotonic(), self.rate, self.burst)

    def take_signed(self, key: str, source: str | None) -> str | None:
        """None when the key and the source both have a token (both are charged); else the spent budget."""
        now = self._monotonic()
        if not self.keys.take(key, now):
            return "key"
        if not self.sources.take("-" if source is None else source_key(source), now):   # an IPv6 /64 is one source
            return "source"
        return None
