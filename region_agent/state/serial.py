"""The zone's SOA serial: a function of the replicated state alone, so equal state answers alike."""

from __future__ import annotations

from region_agent.state.hlc import physical_ms
from region_agent.state.store import StateView


def zone_serial(state: StateView) -> int:
    """Seconds of the newest state change: equal state gives an equal serial everywhere."""
    return max(1, physical_ms(state.newest_hlc) // 1000) % (1 << 32)
