"""Is this agent's clock the outlier? Offsets to the peers, and what a skewed agent must not do.

Every ack of a probe carries the acking member's wall clock; the membership turns it into an offset
(theirs minus ours, corrected by half the round trip: accurate to ±RTT/2). :func:`clock_verdict`
takes the median over the live members measured recently, corrected for any jump of this agent's
own wall clock since (the wall clock moved more or less than the monotonic one): a forward jump of
a day shows at once, before the next probe.

An agent off the median of its peers by more than ``max_offset`` (``cluster.max_clock_offset``), or
whose HLC runs ahead of its own wall clock by more than that (it wrote during a jump that has
since been undone), is the outlier: it is degraded, refuses control-API writes and ACME UPDATEs
(503: nothing is acknowledged that its peers would then refuse), and an alert fires. A correct agent
is never the outlier because of one skewed peer: it is the outlier only when a strict majority of its
live peers see its clock off by more than the bound, on the same side (with one peer, two
agents that disagree both refuse writes: safe, if not available). NTP is assumed everywhere (see
docs/operating.md): without it clocks drift apart, and the agents that drift stop taking writes.

Pure: the offsets, clocks and HLC lead are passed in.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SAMPLE_MAX_AGE = 60.0   # seconds (scheduler time) an offset sample counts for


@dataclass(frozen=True, slots=True)
class ClockVerdict:
    ok: bool
    offset: float | None     # median of the peers' clocks minus ours (seconds); None: no recent sample
    peers: int               # samples the median is of
    lead: float              # how far this agent's HLC is ahead of its wall clock (seconds)
    reason: str = ""


def clock_verdict(offsets: Mapping[str, tuple[float, float, float]], live: Iterable[str], *, now: float,
                  wall: float, lead: float, max_offset: float, max_age: float = SAMPLE_MAX_AGE) -> ClockVerdict:
    """``offsets``: member → (offset, measured at in scheduler time, our wall clock then); ``now``: the
    scheduler's clock; ``wall``: ours now; ``lead``: HLC minus wall clock, seconds."""
    current = []
    peers = list(live)
    for name in peers:
        sample = offsets.get(name)
        if sample is None or now - sample[1] > max_age:
            continue
        offset, at, wall_then = sample
        # Our wall clock moved by (wall - wall_then) while the monotonic one moved (now - at): the difference
        # is a jump of ours, and the peer's offset to us moves the other way by as much.
        current.append(offset - ((wall - wall_then) - (now - at)))
    median = statistics.median(current) if current else None
    if lead > max_offset:
        return ClockVerdict(False, median, len(current), lead,
                            f"this agent's HLC is {lead:.1f} s ahead of its wall clock (it wrote while its clock "
                            f"was {lead:.0f} s fast): writes refused until the clock catches up or the entries "
                            "are dropped")
    ahead = sum(1 for offset in current if offset > max_offset)     # they are ahead: we are behind
    behind = sum(1 for offset in current if offset < -max_offset)
    # A strict majority of the live peers, not only of those measured so far: one fast peer measured
    # first must not make a correct agent the outlier while the others' samples are still coming.
    if median is not None and 2 * max(ahead, behind) > len(peers):
        side = "behind" if ahead > behind else "ahead of"
        return ClockVerdict(False, median, len(current), lead,
                            f"this agent's wall clock is {abs(median):.1f} s {side} the median of {len(current)} "
                            f"peer(s) (bound {max_offset:g} s): writes refused until NTP fixes it")
    return ClockVerdict(True, median, len(current), lead)
