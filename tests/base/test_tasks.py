"""The task supervisor: a failed task is logged, counted, restarted and visible until stable."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from region_agent.base.clock import Backoff
from region_agent.base.tasks import TaskSupervisor
from tests.conftest import wait_for


async def test_a_failing_task_is_restarted_counted_and_reported() -> None:
    registry = CollectorRegistry()
    supervisor = TaskSupervisor(registry, stable_after=0.3,
                                backoff=lambda: Backoff(initial=0.01, cap=0.02, reset_after=1.0))
    runs: list[int] = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) <= 2:
            raise RuntimeError(f"boom {len(runs)}")
        await asyncio.Event().wait()

    supervisor.spawn("flaky", flaky)
    try:
        await wait_for(lambda: len(runs) == 3, message="third run")
        assert registry.get_sample_value("region_agent_task_restarts_total", {"task": "flaky"}) == 2
        (problem,) = supervisor.problems()
        assert problem.startswith("task flaky restarted (2 restarts): RuntimeError: boom 2")
        await wait_for(lambda: supervisor.problems() == (), timeout=3, message="stable again")
        assert registry.get_sample_value("region_agent_task_running", {"task": "flaky"}) == 1
    finally:
        await supervisor.stop(budget=1)


async def test_an_unexpected_return_is_a_failure_and_stop_cancels() -> None:
    registry = CollectorRegistry()
    supervisor = TaskSupervisor(registry, stable_after=60,
                                backoff=lambda: Backoff(initial=30, cap=30, jitter=0.0))
    cancelled = asyncio.Event()

    async def returns() -> None:
        return None

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    supervisor.spawn("returns", returns)
    supervisor.spawn("forever", forever)
    await wait_for(supervisor.problems, message="a problem")
    assert supervisor.problems() == ("task returns waiting to restart (1 restarts): exited unexpectedly",)
    assert registry.get_sample_value("region_agent_task_running", {"task": "returns"}) == 0
    assert registry.get_sample_value("region_agent_task_restarts_total", {"task": "forever"}) == 0
    await supervisor.stop(budget=1)
    assert cancelled.is_set()
