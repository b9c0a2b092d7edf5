"""When a checked target is up or down: pure, with the quick re-check.

PowerDNS 4.7 flips on a single failed check and waits a whole interval for the next one.
Here a target goes down only after ``fall`` consecutive failures and up after ``rise``
consecutive successes, and a result that disagrees with the current state is confirmed
by a re-check ``recheck_delay`` later instead of an interval later. So one lost check
never flips a target, and a real failure is acted on about ``recheck_delay`` after the
first check that sees it.

At start a target is UNKNOWN: its first success makes it UP at once and its first
failure is re-checked quickly, so the first round completes within about
``timeout + recheck_delay`` even for dead targets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TargetHealth(enum.Enum):
    UNKNOWN = "unknown"
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class CheckRule:
    interval: float = 5.0
    recheck_delay: float = 0.1
    fall: int = 2
    rise: int = 2


@dataclass(slots=True)
class TargetState:
    health: TargetHealth = TargetHealth.UNKNOWN
    failures: int = 0  # consecutive
    successes: int = 0  # consecutive
    detail: str = "not checked yet"

    def observe(self, ok: bool, detail: str, rule: CheckRule) -> float:
        """Account for one check result; returns the delay until the next check."""
        self.detail = detail
        if ok:
            self.successes += 1
            self.failures = 0
            if self.health is TargetHealth.UNKNOWN or (
                self.health is TargetHealth.DOWN and self.successes >= rule.rise
            ):
                self.health = TargetHealth.UP
            return rule.interval if self.health is TargetHealth.UP else rule.recheck_delay
        self.failures += 1
        self.successes = 0
        if self.health is not TargetHealth.DOWN and self.failures >= rule.fall:
            self.health = TargetHealth.DOWN
        return rule.interval if self.health is TargetHealth.DOWN else rule.recheck_delay
