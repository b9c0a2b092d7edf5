"""Timers for the membership logic: one interface, a virtual-time implementation and an asyncio one.

The state machine never sleeps: it asks a :class:`Scheduler` to call it back later and reads the
time from it. Tests and the simulator drive :class:`VirtualScheduler` by hand; the daemon uses
:class:`AsyncioScheduler` on the running loop.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` once after ``delay`` seconds, unless the returned timer is cancelled."""
        ...


class _VirtualTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualScheduler:
    """Time moves only in :meth:`run_until`/:meth:`run_for`; callbacks run in time order (FIFO on ties)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[tuple[float, int, _VirtualTimer]] = []
        self._seq = 0
        self.executed = 0

    def now(self) -> float:
        return self._now

    def call_later(self, delay: float, callback: Callable[[], None]) -> _VirtualTimer:
        timer = _VirtualTimer(self._now + max(0.0, delay), callback)
        self._seq += 1
        heapq.heappush(self._heap, (timer.when, self._seq, timer))
        return timer

    def run_until(self, deadline: float, *, stop: Callable[[], bool] | None = None) -> bool:
        """Run every callback due up to ``deadline``; returns True early when ``stop()`` becomes true."""
        while self._heap and self._heap[0][0] <= deadline:
            when, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            self._now = when
            timer.callback()
            self.executed += 1
            if stop is not None and stop():
                return True
        self._now = max(self._now, deadline)
        return stop is not None and stop()

    def run_for(self, seconds: float, *, stop: Callable[[], bool] | None = None) -> bool:
        return self.run_until(self._now + seconds, stop=stop)


class AsyncioScheduler:
    """The running event loop's clock and timers."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()

    def now(self) -> float:
        return self._loop.time()

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self._loop.call_later(max(0.0, delay), callback)
