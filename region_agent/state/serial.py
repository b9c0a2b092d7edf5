"""The zone's SOA serial: a function of the replicated state alone, so equal state answers alike.

The serial counts :data:`TICK_MS` ticks of the newest change's HLC time, modulo 2**32: every
change a tick or more after the previous one moves it (a change within the same second as the
last one did not, when it counted seconds), and RFC 1982 comparison holds between serials less
than 2**31 ticks (248 days) apart. The store never expires its newest entry, so the serial
never goes back, across restarts and snapshots included.
"""

from __future__ import annotations

from region_agent.state.hlc import physical_ms
from region_agent.state.store import StateView

TICK_MS = 10


def zone_serial(state: StateView) -> int:
    """The newest state change in 10 ms ticks: equal state gives an equal serial everywhere."""
    return max(1, physical_ms(state.newest_hlc) // TICK_MS) % (1 << 32)
