"""Time sources and jittered backoff.

Components take a :class:`Clock` instead of calling :mod:`time` so tests can drive time
by hand. ``monotonic`` measures durations; ``wall`` is only for values other processes
read (timestamps in records, HLC physical time).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
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
    """A clock that moves only when told to (tests).

    Also a ``Sleep``: :meth:`sleep` returns once :meth:`advance` has moved monotonic time past
    its deadline, so a test plays minutes of timers in no real time. :meth:`wall_ms` is the
    wall clock in milliseconds, as :class:`~region_agent.state.hlc.HybridClock` reads it, and
    :meth:`step_wall` moves the wall clock alone (an NTP step), as a real host's may.
    """

    now_monotonic: float = 1000.0
    now_wall: float = 1_800_000_000.0
    _sleepers: list[tuple[float, int, asyncio.Future[None]]] = field(
        default_factory=list, init=False, repr=False, compare=False)
    _order: itertools.count[int] = field(default_factory=itertools.count, init=False, repr=False, compare=False)

    def monotonic(self) -> float:
        return self.now_monotonic

    def wall(self) -> float:
        return self.now_wall

    def wall_ms(self) -> int:
        return round(self.now_wall * 1000)

    def advance(self, seconds: float) -> None:
        """Move both clocks forward, waking every sleeper whose deadline is reached (in deadline order;
        they run when the caller next yields to the event loop)."""
        self.now_monotonic += seconds
        self.now_wall += seconds
        while self._sleepers and self._sleepers[0][0] <= self.now_monotonic:
            _, _, woken = heapq.heappop(self._sleepers)
            if not woken.done():
                woken.set_result(None)

    def step_wall(self, seconds: float) -> None:
        """Move the wall clock alone, forward or back; monotonic time and sleepers are not touched."""
        self.now_wall += seconds

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now_monotonic + seconds, next(self._order), woken))
        await woken


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
