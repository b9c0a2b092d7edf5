"""Hybrid logical clock (Kulkarni et al. 2014) packed into one integer.

A timestamp is ``physical_ms << 16 | logical``: it sorts like wall time, never goes
backwards on one writer even if the wall clock does, and after :meth:`observe` of a
remote timestamp every later local timestamp is greater than it. Ties between writers are
broken by the writer id in :class:`region_agent.state.store.Version`, so the order is total.
"""

from __future__ import annotations

from collections.abc import Callable

LOGICAL_BITS = 16
LOGICAL_MASK = (1 << LOGICAL_BITS) - 1
# A remote timestamp further ahead of our wall clock than this is refused, so one agent
# with a broken clock cannot drag every clock in the cluster into the future.
MAX_FORWARD_DRIFT_MS = 60_000


class ClockDriftError(ValueError):
    """A remote HLC timestamp is too far ahead of the local wall clock."""


def pack(physical_ms: int, logical: int = 0) -> int:
    return (physical_ms << LOGICAL_BITS) | logical


def physical_ms(timestamp: int) -> int:
    return timestamp >> LOGICAL_BITS


class HybridClock:
    def __init__(self, wall_ms: Callable[[], int], max_drift_ms: int = MAX_FORWARD_DRIFT_MS) -> None:
        self._wall_ms = wall_ms
        self._last = 0
        self.max_drift_ms = max_drift_ms   # a cluster sets it from cluster.max_clock_offset

    def now(self) -> int:
        """A timestamp greater than every one this clock issued or observed before."""
        wall = pack(self._wall_ms())
        self._last = wall if wall > self._last else self._last + 1
        return self._last

    def check(self, remote: int) -> None:
        """Raise :class:`ClockDriftError` if ``remote`` is too far ahead; changes nothing."""
        if physical_ms(remote) - self._wall_ms() > self.max_drift_ms:
            raise ClockDriftError(
                f"remote timestamp {physical_ms(remote)} ms is more than "
                f"{self.max_drift_ms} ms ahead of local wall clock"
            )

    def observe(self, remote: int) -> None:
        """Account for a timestamp received from another writer."""
        self.check(remote)
        self.advance(remote)

    def advance(self, remote: int) -> None:
        """Account for a timestamp already :meth:`check`-ed (never raises)."""
        self._last = max(self._last, remote)

    def wall_ms(self) -> int:
        """The wall clock this HLC reads (milliseconds since the epoch)."""
        return self._wall_ms()

    @property
    def last(self) -> int:
        return self._last

    def lead_ms(self) -> int:
        """How far this clock's last timestamp is ahead of the wall clock (0 when it is not)."""
        return max(0, physical_ms(self._last) - self._wall_ms())

    def reset(self, floor: int) -> None:
        """Forget a lead (after the entries stamped with it were dropped): the next timestamp is above
        ``floor`` (the newest entry kept) and otherwise wall time again."""
        self._last = floor
