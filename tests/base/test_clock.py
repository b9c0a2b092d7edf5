"""ManualClock, the tests' one time double: both clocks move by hand, and sleepers wake as it moves."""

from __future__ import annotations

import asyncio

from region_agent.base.clock import Clock, ManualClock


def test_advance_moves_both_clocks_and_a_wall_step_only_the_wall() -> None:
    clock: Clock = ManualClock()
    assert (clock.monotonic(), clock.wall()) == (1000.0, 1_800_000_000.0)
    manual = ManualClock(now_monotonic=5.0, now_wall=100.0)
    manual.advance(2.5)
    assert (manual.monotonic(), manual.wall(), manual.wall_ms()) == (7.5, 102.5, 102_500)
    manual.step_wall(-10)  # an NTP step back: durations are not touched
    assert (manual.monotonic(), manual.wall(), manual.wall_ms()) == (7.5, 92.5, 92_500)


async def test_sleepers_wake_in_deadline_order_once_time_reaches_them() -> None:
    clock = ManualClock()
    woke: list[str] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(name)

    tasks = [asyncio.create_task(sleeper(name, seconds)) for name, seconds in (("late", 10), ("early", 3),
                                                                                ("also early", 3))]
    await asyncio.sleep(0)  # every sleeper is waiting
    clock.advance(2.9)
    await asyncio.sleep(0)
    assert woke == []
    clock.advance(0.1)  # exactly the deadline wakes
    await asyncio.gather(*tasks[1:])
    assert woke == ["early", "also early"] and not tasks[0].done()
    clock.advance(100)
    await tasks[0]
    assert woke == ["early", "also early", "late"]


async def test_sleeping_no_time_returns_at_once() -> None:
    clock = ManualClock()
    await asyncio.wait_for(clock.sleep(0), 1)
    await asyncio.wait_for(clock.sleep(-1), 1)
    assert clock.monotonic() == 1000.0
