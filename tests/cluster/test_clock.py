"""Which agent is the outlier: deterministic clocks, every case of issue 20's skew list."""

from __future__ import annotations

import pytest

from region_agent.cluster.clock import clock_verdict

NOW, WALL = 1000.0, 1_800_000_000.0
PEERS = ("b", "c", "d")


def _at(offset: float, age: float = 1.0) -> tuple[float, float, float]:
    """A sample measured ``age`` seconds ago, when our wall clock read what it should."""
    return (offset, NOW - age, WALL - age)


@pytest.mark.parametrize(("offsets", "ok"), [
    ({"b": _at(0.01), "c": _at(-0.02), "d": _at(0.0)}, True),          # NTP-close
    ({"b": _at(3600), "c": _at(3600), "d": _at(3600)}, False),          # we are an hour slow
    ({"b": _at(-86_400), "c": _at(-86_400), "d": _at(0.1)}, False),     # we are a day fast (2 of 3 see it)
    ({"b": _at(59), "c": _at(0.0), "d": _at(0.0)}, True),              # one peer 59 s fast: not our problem
    ({"b": _at(59), "c": _at(0.0)}, True),                              # two peers, one fast: no majority
    ({"b": _at(2.5), "c": _at(-2.5), "d": _at(0.0)}, True),            # disagreement without a side
    ({}, True),                                                         # alone: nothing to compare with
    ({"b": _at(3600)}, True),                     # the one measured so far is the skewed one: the others decide
    ({"b": _at(3600, age=120), "c": _at(3600, age=120)}, True),        # stale samples do not count
])
def test_the_outlier_is_the_one_a_majority_of_its_peers_sees_off(offsets: dict[str, tuple[float, float, float]],
                                                                  ok: bool) -> None:
    verdict = clock_verdict(offsets, PEERS, now=NOW, wall=WALL, lead=0.0, max_offset=1.0)
    assert verdict.ok is ok, verdict


def test_a_jump_of_our_own_clock_shows_before_the_next_probe() -> None:
    """Measured at 0 offset a second ago; since then our wall clock jumped a day forward (the monotonic clock
    moved one second): every peer is now a day behind us."""
    offsets = {p: _at(0.0) for p in PEERS}
    verdict = clock_verdict(offsets, PEERS, now=NOW, wall=WALL + 86_400, lead=0.0, max_offset=1.0)
    assert not verdict.ok and verdict.offset is not None and verdict.offset < -86_000 and "ahead of" in verdict.reason


def test_an_hlc_ahead_of_the_wall_clock_refuses_until_it_recovers() -> None:
    """After writing during a jump that has been undone: the peers agree with our wall clock, but the HLC is a
    day ahead of it; every write would carry a time the peers refuse."""
    offsets = {p: _at(0.0) for p in PEERS}
    assert not clock_verdict(offsets, PEERS, now=NOW, wall=WALL, lead=86_400.0, max_offset=1.0).ok
    assert clock_verdict(offsets, PEERS, now=NOW, wall=WALL, lead=0.2, max_offset=1.0).ok
