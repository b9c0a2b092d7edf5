"""Background tasks: every eternal task is named, supervised, restarted and visible."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from region_agent.base.clock import Backoff

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


@dataclass
class _Supervised:
    name: str
    factory: Callable[[], Coroutine[Any, Any, Any]]
    backoff: Backoff
    task: asyncio.Task[Any] | None = None
    started_at: float = 0.0
    restarts: int = 0
    last_error: str | None = None
    failed_at: float | None = None


class TaskSupervisor:
    """Runs the agent's long-lived tasks and restarts any that fails, with backoff.

    Each task is a factory of coroutines meant to run until cancelled. A raise (or an
    unexpected return) is logged with its traceback, counted in
    ``region_agent_task_restarts_total{task}``, and the task is started again after a
    jittered, growing delay. :meth:`problems` names every task that failed and has not yet
    run ``stable_after`` seconds since: the agent is degraded while that list is not empty.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, stable_after: float = 60.0,
                 backoff: Callable[[], Backoff] | None = None, log: logging.Logger = logger) -> None:
        self.stable_after = stable_after
        self._backoff = backoff or (lambda: Backoff(initial=0.5, cap=30.0, reset_after=stable_after))
        self._log = log
        self._tasks: dict[str, _Supervised] = {}
        self._stopping = False
        self.restarts = Counter("region_agent_task_restarts", "Restarts of a failed long-running task",
                                ["task"], registry=registry)
        self.running = Gauge("region_agent_task_running", "1 while the task runs, 0 while it waits to restart",
                             ["task"], registry=registry)

    def spawn(self, name: str, factory: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        if name in self._tasks:
            raise ValueError(f"task {name!r} is already supervised")
        entry = _Supervised(name, factory, self._backoff())
        self._tasks[name] = entry
        self.restarts.labels(name)  # the series exists at 0 before the first restart
        self._start(entry)

    def _start(self, entry: _Supervised) -> None:
        entry.started_at = time.monotonic()
        entry.task = asyncio.get_running_loop().create_task(self._run(entry), name=entry.name)

    async def _run(self, entry: _Supervised) -> None:
        while True:
            self.running.labels(entry.name).set(1)
            try:
                await entry.factory()
                error = "exited unexpectedly"
                self._log.error("task %s exited unexpectedly", entry.name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"[:300]
                self._log.error("task %s failed", entry.name, exc_info=exc)
            self.running.labels(entry.name).set(0)
            now = time.monotonic()
            entry.restarts += 1
            entry.last_error = error
            entry.failed_at = now
            self.restarts.labels(entry.name).inc()
            delay = entry.backoff.next_delay(now)
            self._log.warning("task %s restarts in %.1f s (restart %d)", entry.name, delay, entry.restarts)
            await asyncio.sleep(delay)
            entry.started_at = time.monotonic()

    def problems(self, now: float | None = None) -> tuple[str, ...]:
        """Every task that failed and has not run ``stable_after`` seconds since."""
        now = time.monotonic() if now is None else now
        out = []
        for entry in self._tasks.values():
            if entry.failed_at is None:
                continue
            waiting = entry.started_at <= entry.failed_at
            if waiting or now - entry.started_at < self.stable_after:
                state = "waiting to restart" if waiting else "restarted"
                out.append(f"task {entry.name} {state} ({entry.restarts} restarts): {entry.last_error}")
        return tuple(out)

    def tasks(self) -> list[asyncio.Task[Any]]:
        return [entry.task for entry in self._tasks.values() if entry.task is not None]

    async def stop(self, *, budget: float = 5.0) -> None:
        """Cancel every task in reverse start order and wait up to ``budget`` seconds."""
        tasks = self.tasks()
        self._tasks.clear()
        await cancel_and_wait(tasks, budget=budget)
