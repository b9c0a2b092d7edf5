"""One suspicion of one member: a timer that independent confirmations shorten (Lifeguard).

It starts at ``maximum`` and, with C distinct confirmers besides the first accuser, fires at
``start + suspicion_timeout(min, max, C, K)`` — ``min`` once K confirmations arrived. A member
that is really dead gets suspected by many probers and is declared dead quickly; a member
suspected by one node with a bad link has the full ``maximum`` to refute.
"""

from __future__ import annotations

from collections.abc import Callable

from region_agent.gossip.config import suspicion_timeout
from region_agent.gossip.scheduler import Scheduler, Timer


class Suspicion:
    def __init__(self, scheduler: Scheduler, *, accuser: str, minimum: float, maximum: float, expected: int,
                 on_timeout: Callable[[], None]) -> None:
        self._scheduler = scheduler
        self._min = minimum
        self._max = maximum
        self._expected = expected
        self._on_timeout = on_timeout
        self._confirmers = {accuser}
        self.started = scheduler.now()
        self.deadline = self.started + suspicion_timeout(minimum, maximum, 0, expected)
        self._timer: Timer = scheduler.call_later(self.deadline - self.started, self._fire)
        self._fired = False

    @property
    def confirmations(self) -> int:
        return len(self._confirmers) - 1

    def confirm(self, confirmer: str) -> bool:
        """Record an accusation from ``confirmer``; True when it is new (then it is worth re-gossiping)."""
        if self._fired or confirmer in self._confirmers or self.confirmations >= self._expected:
            return False
        self._confirmers.add(confirmer)
        self.deadline = self.started + suspicion_timeout(self._min, self._max, self.confirmations, self._expected)
        self._timer.cancel()
        self._timer = self._scheduler.call_later(self.deadline - self._scheduler.now(), self._fire)
        return True

    def cancel(self) -> None:
        self._fired = True
        self._timer.cancel()

    def _fire(self) -> None:
        if not self._fired:
            self._fired = True
            self._on_timeout()
