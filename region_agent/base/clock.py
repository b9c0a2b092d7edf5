"""Time sources and jittered backoff.

Components take a :class:`Clock` instead of calling :mod:`time` so tests can drive time
by hand. ``monotonic`` measures durations; ``wall`` is only for values other processes
read (timestamps in records, HLC physical time).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


@dataclass
class ManualClock:
    """A clock that moves only when told to (tests)."""

    now_monotonic: float = 1000.0
    now_wall: float = 1_800_000_000.0

    def monotonic(self) -> float:
        return self.now_monotonic

    def wall(self) -> float:
        return self.now_wall

    def advance(self, seconds: float) -> None:
        self.now_monotonic += seconds
        self.now_wall += seconds


@dataclass
class Backoff:
    """Exponential backoff with full jitter, reset after a healthy stretch.

    delay = uniform(0, min(cap, initial * factor**attempt)) when ``jitter`` is 1.0 ("full
    jitter"): retries of many agents spread out instead of arriving in waves. client-go's
    reflector uses 800 ms, x2, cap 30 s, reset after 2 min, which is the default here.
    """

    initial: float = 0.8
    factor: float = 2.0
    cap: float = 30.0
    jitter: float = 1.0
    reset_after: float = 120.0
    rng: random.Random = field(default_factory=random.Random)
    _attempt: int = 0
    _last_failure: float | None = None

    def next_delay(self, now: float) -> float:
        if self._last_failure is not None and now - self._last_failure > self.reset_after:
            self._attempt = 0
        self._last_failure = now
        ceiling = min(self.cap, self.initial * self.factor**self._attempt)
        self._attempt += 1
        return ceiling * (1.0 - self.jitter * self.rng.random())

    def reset(self) -> None:
        self._attempt = 0
        self._last_failure = None

    @property
    def attempt(self) -> int:
        return self._attempt
