"""Run in a child process: a real Checker against a real endpoint while descriptors run out.

Prints one JSON line: every copy-health value the checker wrote, the local errors it
counted, whether it reported itself degraded while descriptors were exhausted, and the
target's state throughout. The parent test asserts on it; exhausting descriptors in the
test process itself would break the test runner.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time

from prometheus_client import CollectorRegistry

from region_agent.checks.checker import CheckConfig, Checker
from region_agent.checks.rule import CheckRule, TargetHealth
from region_agent.demo.fake_copy import HealthEndpoint
from region_agent.state.hlc import HybridClock
from region_agent.state.model import Project, Region, project_key, region_key
from region_agent.state.observations import Observations
from region_agent.state.store import Store


async def _until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        await asyncio.sleep(0.01)


async def main() -> None:
    endpoint = HealthEndpoint("127.0.0.31")
    port = await endpoint.start()
    store = Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    store.put(region_key("sfo1"), Region("sfo1", ipv4=("127.0.0.31",)))
    store.put(project_key("shop"), Project("shop", ("sfo1",)))
    observations = Observations()
    written: list[dict[str, object]] = []

    def record(copies: list[tuple[str, str]]) -> None:
        for copy in copies:
            health = observations.get(copy)
            written.append({"key": list(copy), "healthy": None if health is None else health.healthy})

    observations.subscribe(record)
    checker = Checker(store, CheckConfig(port=port, host="h.example", timeout=0.5,
                                         rule=CheckRule(interval=0.1, recheck_delay=0.05, fall=1, rise=1)),
                      CollectorRegistry(), observations=observations)
    task = asyncio.create_task(checker.run())
    await _until(checker.first_round.is_set)
    (target,) = checker.states
    states = [checker.states[target].health.value]

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hoard: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        while True:
            hoard.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    await _until(lambda: checker.local_errors >= 5)
    states.append(checker.states[target].health.value)
    degraded_during = checker.problem()
    for fd in hoard:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    before = len(endpoint.records)
    await _until(lambda: len(endpoint.records) >= before + 2)
    states.append(checker.states[target].health.value)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await endpoint.stop()
    print(json.dumps({"written": written, "local_errors": checker.local_errors, "degraded": degraded_during,
                      "states": states, "up": TargetHealth.UP.value}))


if __name__ == "__main__":
    asyncio.run(main())
