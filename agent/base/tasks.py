"""Guarded background tasks: every eternal task is named, and an unexpected exit is logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger("region_agent.tasks")


def create_guarded_task(
    coro: Coroutine[Any, Any, Any], *, name: str, log: logging.Logger = logger
) -> asyncio.Task[Any]:
    """Start ``coro`` as a named task whose failure or unexpected return is logged.

    The task is meant to run until cancelled; returning or raising is a bug worth a loud
    log line, because nothing else would notice that, say, the DNS server stopped. The
    check is a done-callback rather than a wrapper coroutine, so a task cancelled before
    it ever ran leaves no never-awaited coroutine behind.
    """

    def report(task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("task %s failed", name, exc_info=error)
        else:
            log.warning("task %s exited unexpectedly", name)

    task = asyncio.get_running_loop().create_task(coro, name=name)
    task.add_done_callback(report)
    return task


async def cancel_and_wait(tasks: list[asyncio.Task[Any]], *, budget: float = 5.0) -> None:
    """Cancel tasks in reverse start order and wait for them up to ``budget`` seconds."""
    for task in reversed(tasks):
        task.cancel()
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=budget)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            logger.debug("task %s ended with %r", task.get_name(), task.exception())
    if pending:
        logger.error("%d task(s) did not stop within %.1f s: %s", len(pending), budget,
                     ", ".join(t.get_name() for t in pending))
