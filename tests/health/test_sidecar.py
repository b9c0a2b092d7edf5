"""The health sidecar as a REAL process (``python -m region_agent.health.sidecar``) fed by a publisher here.

Short staleness bounds keep these fast; every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from region_agent.health.feed import FeedPublisher
from region_agent.state.local import CopyReason
from tests.fakes.ports import free_port
from tests.health.helpers import copy, view, wait_until

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = 0.1
V1 = view([copy("shop"), copy("blog", CopyReason.NO_READY_REVISION, detail="revision blog-00002 failed")])


@dataclasses.dataclass
class Sidecar:
    process: asyncio.subprocess.Process
    base: str
    operator: str  # its own /metrics, on the sidecar's operator port
    log: Path
    bound: float



@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "feed.sock"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        yield session


@pytest.fixture
async def start_publisher(socket_path: Path) -> AsyncIterator[Callable[[], Awaitable[FeedPublisher]]]:
    made: list[FeedPublisher] = []

    async def start() -> FeedPublisher:
        publisher = FeedPublisher(
            socket_path=socket_path, registry=CollectorRegistry(), heartbeat_interval=HEARTBEAT, min_interval=0.0
        )
        await publisher.start()
        made.append(publisher)
        return publisher

    yield start
    for publisher in made:
        await publisher.stop()


@pytest.fixture
async def start_sidecar(
    socket_path: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> AsyncIterator[Callable[[float], Awaitable[Sidecar]]]:
    started: list[Sidecar] = []

    async def start(bound: float) -> Sidecar:
        port, operator_port = free_port(), free_port()
        log = tmp_path / f"sidecar-{len(started)}.log"
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "region_agent.health.sidecar", "--region", "sfo1",
                "--feed-socket", str(socket_path),
                "--listen", "127.0.0.1", "--port", str(port), "--operator-port", str(operator_port),
                "--stale-after", str(bound),
                "--heartbeat-interval", str(HEARTBEAT), "--reconnect-max", "0.1",
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=out,
            )
        sidecar = Sidecar(process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{operator_port}", log, bound)
        started.append(sidecar)

        async def listening() -> bool:
            assert process.returncode is None, log.read_text()
            try:
                await status_of(http, f"{sidecar.base}/livez")
            except aiohttp.ClientError:
                return False
            return True

        await wait_until(listening, timeout=20, message="the sidecar to listen")
        return sidecar

    yield start
    for sidecar in started:
        if sidecar.process.returncode is None:
            sidecar.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(sidecar.process.wait(), timeout=10)
            except TimeoutError:
                sidecar.process.kill()
                await sidecar.process.wait()
                pytest.fail(f"sidecar ignored SIGTERM:\n{sidecar.log.read_text()}")
            assert sidecar.process.returncode == 0, sidecar.log.read_text()


async def status_of(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url) as response:
        return response.status, await response.text()


async def metric(http: aiohttp.ClientSession, sidecar: Sidecar, sample: str) -> float:
    _, text = await status_of(http, f"{sidecar.operator}/metrics")
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


async def test_fed_sidecar_answers_from_the_agents_view(
    start_publisher: Callable[[], Awaitable[FeedPublisher]],
    start_sidecar: Callable[[float], Awaitable[Sidecar]],
    http: aiohttp.ClientSession,
) -> None:
    sidecar = await start_sidecar(5.0)
    assert await status_of(http, f"{sidecar.base}/global-health/shop") == (503, "stale")  # not fed yet
    assert (await status_of(http, f"{sidecar.base}/readyz"))[0] == 503
    publisher = await start_publisher()
    publisher.publish(V1)
    await wait_until(lambda: _is(http, f"{sidecar.base}/readyz", (200, "ready")), message="ready")
    await wait_until(
        lambda: _is(http, f"{sidecar.base}/global-health/shop", (200, "ok")), message="shop ok"
    )
    assert await status_of(http, f"{sidecar.base}/global-health/blog") == (503, "no-ready-revision")
    assert await status_of(http, f"{sidecar.base}/global-health/nobody") == (404, "not-found")
    async with http.get(f"{sidecar.base}/health/region") as response:
        body = await response.json()
        assert body["mode"] == "sidecar" and body["feed"]["stale"] is False
        assert "X-Degraded" not in response.headers
    publisher.publish(dataclasses.replace(V1, copies={**V1.copies, "blog": copy("blog")}))
    await wait_until(lambda: _is(http, f"{sidecar.base}/global-health/blog", (200, "ok")), message="change")


async def _is(http: aiohttp.ClientSession, url: str, expected: tuple[int, str]) -> bool:
    return await status_of(http, url) == expected


async def test_answers_turn_stale_only_after_the_bound(
    start_publisher: Callable[[], Awaitable[FeedPublisher]],
    start_sidecar: Callable[[float], Awaitable[Sidecar]],
    http: aiohttp.ClientSession,
) -> None:
    bound = 1.0
    sidecar = await start_sidecar(bound)
    publisher = await start_publisher()
    publisher.publish(V1)
    url = f"{sidecar.base}/global-health/shop"
    await wait_until(lambda: _is(http, url, (200, "ok")), message="fed")
    await publisher.stop()
    stopped = time.monotonic()
    answers: list[tuple[float, tuple[int, str]]] = []

    async def stale_yet() -> bool:
        answer = await status_of(http, url)
        answers.append((time.monotonic() - stopped, answer))
        return answer == (503, "stale")

    await wait_until(stale_yet, timeout=bound + 5, interval=0.005, message="stale")
    first_stale = answers[-1][0]
    # The sidecar last heard the agent at most one heartbeat before the stop.
    assert first_stale >= bound - HEARTBEAT - 0.05, answers
    assert all(answer == (200, "ok") for _, answer in answers[:-1]), answers
    assert (await status_of(http, f"{sidecar.base}/readyz"))[0] == 503
    async with http.get(f"{sidecar.base}/health/region") as response:
        assert response.headers["X-Degraded"] == "true"
        assert "feed-stale" in response.headers["X-Degraded-Reason"]
    # The agent comes back: answers recover.
    again = await start_publisher()
    again.publish(V1)
    await wait_until(lambda: _is(http, url, (200, "ok")), message="recovered")


async def test_agent_restart_within_the_bound_does_not_flap(
    start_publisher: Callable[[], Awaitable[FeedPublisher]],
    start_sidecar: Callable[[float], Awaitable[Sidecar]],
    http: aiohttp.ClientSession,
) -> None:
    sidecar = await start_sidecar(4.0)
    old = await start_publisher()
    old.publish(V1)
    url = f"{sidecar.base}/global-health/shop"
    await wait_until(lambda: _is(http, url, (200, "ok")), message="fed")
    answers: list[tuple[int, str]] = []
    polling = True

    async def poll() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as own:
            while polling:
                answers.append(await status_of(own, url))
                await asyncio.sleep(0.002)  # pace the poller; not a wait for a condition

    poller = asyncio.get_running_loop().create_task(poll())
    await wait_until(lambda: len(answers) >= 10)
    await old.stop()  # the agent restarts
    await wait_until(lambda: _connected(http, sidecar, 0.0), message="the sidecar noticed")
    new = await start_publisher()
    new.publish(view([copy("shop")], synced=False))  # its first LIST is still running
    await wait_until(
        lambda: _metric_at_least(http, sidecar, 'region_agent_health_feed_messages_total{type="snapshot"}', 2),
        message="the restarted agent's unsynced snapshot",
    )
    n_before_sync = len(answers)
    await wait_until(lambda: len(answers) >= n_before_sync + 10)
    new.publish(view([copy("shop"), copy("fresh")]))
    await wait_until(lambda: _is(http, f"{sidecar.base}/global-health/fresh", (200, "ok")), message="new view")
    n_after = len(answers)
    await wait_until(lambda: len(answers) >= n_after + 10)
    polling = False
    await poller
    assert len(answers) >= 30
    assert set(answers) == {(200, "ok")}, [a for a in answers if a != (200, "ok")][:5]


async def _connected(http: aiohttp.ClientSession, sidecar: Sidecar, value: float) -> bool:
    return await metric(http, sidecar, "region_agent_health_feed_connected") == value


async def _metric_at_least(http: aiohttp.ClientSession, sidecar: Sidecar, sample: str, value: float) -> bool:
    return await metric(http, sidecar, sample) >= value
