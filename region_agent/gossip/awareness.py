"""Lifeguard local health: a score that grows when this node itself looks unhealthy.

A node that misses nacks it was promised, or has to refute suspicions of itself, is probably the
slow one (CPU starved, lossy link). It then stretches its probe interval and timeout by
``score + 1`` instead of accusing healthy members. Successful probes bring the score back down.
"""

from __future__ import annotations


class Awareness:
    def __init__(self, max_multiplier: int) -> None:
        if max_multiplier < 1:
            raise ValueError("max_multiplier must be >= 1")
        self._max = max_multiplier
        self.score = 0

    def apply(self, delta: int) -> None:
        """Add ``delta`` and clamp to ``0 .. max_multiplier - 1``."""
        self.score = min(self._max - 1, max(0, self.score + delta))

    def scale(self, seconds: float) -> float:
        return seconds * (self.score + 1)
