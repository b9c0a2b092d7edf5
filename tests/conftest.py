"""Shared test helpers: wait on a condition with a deadline, never on a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar, overload

import pytest

T = TypeVar("T")

# Agents started by tests stop at once on SIGTERM (the rollout drain is tested on its own,
# tests/e2e/test_drain.py, which sets it explicitly).
os.environ.setdefault("REGION_AGENT_SHUTDOWN_DRAIN_SECONDS", "0")


@overload
async def wait_for(
    condition: Callable[[], Awaitable[T]], *, timeout: float = ..., interval: float = ..., message: str = ...
) -> T: ...


@overload
async def wait_for(
    condition: Callable[[], T], *, timeout: float = ..., interval: float = ..., message: str = ...
) -> T: ...


async def wait_for(
    condition: Callable[[], Any],
    *,
    timeout: float = 5.0,
    interval: float = 0.01,
    message: str = "condition",
) -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds.

    Returns the truthy value so a test can assert on what it waited for.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        last = result
        if result:
            return result  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}; last value {last!r}")
        await asyncio.sleep(interval)


def wait_for_sync(
    condition: Callable[[], T], *, timeout: float = 5.0, interval: float = 0.01, message: str = "condition"
) -> T:
    """The same for code outside an event loop (subprocess tests)."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}; last value {result!r}")
        time.sleep(interval)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI a skipped ``external`` test is a failure: the program it needs must be installed.

    ``scripts/test.sh`` installs every program those tests drive; a skip there would let a
    broken install step pass unnoticed.
    """
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and os.environ.get("CI") and item.get_closest_marker("external") is not None:
        report.outcome = "failed"
        report.longrepr = f"external test skipped under CI: {report.longrepr}"
