"""SIGKILL the usage process in the middle of a batch with sessions open, restart it, check the bill.

Real processes and real time: the agent (``tests.agent.usage.agent_process``) talks to the fake
apiserver and the fake control plane of this test over loopback. Kubernetes timestamps are whole
seconds, which is the billing granularity: a session's end may be billed up to 1 s late when the
pod's final state reaches the agent after a checkpoint already billed that second (the rule in
``agent.usage.sessions``: billed seconds are never taken back). Every other second is exact,
including sessions that were open across the crash. The one designed loss is asserted exactly: a
pod that vanished while the agent was dead, without a deletion time the agent had seen, is
billed up to its last persisted checkpoint (at most one checkpoint interval before the kill).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.kube.resources import PODS
from tests.agent.usage.factory import down, pod, running, up, waiting
from tests.conftest import wait_for
from tests.fakes.control_plane import FakeControlPlane
from tests.fakes.kube_api import FakeKubeApi

ROOT = Path(__file__).resolve().parents[3]
NODE = "node-a"
CHECKPOINT = 1.0


class AgentProcess:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = env
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        stderr = self.log.open("ab")  # a local file, opened once per start
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.agent.usage.agent_process", cwd=ROOT, env=self.env,
                stdout=asyncio.subprocess.PIPE, stderr=stderr)
        finally:
            stderr.close()  # the child holds its own descriptor
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout=20)
        assert line.strip() == b"reconciled", f"agent did not start: {line!r}; see {self.log}"

    async def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        assert await self.proc.wait() == -signal.SIGKILL

    async def terminate(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.proc.wait(), timeout=20)


class Spool:
    """Read-only look into the agent's SQLite spool (WAL allows a reader beside the writer)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _query(self, sql: str) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute(sql).fetchall()
        finally:
            conn.close()

    def ledgers(self) -> dict[str, dict[str, Any]]:
        rows = [json.loads(body) for (body,) in self._query("SELECT body FROM ledgers")]
        return {row["identity"]["uid"]: row for row in rows}

    def unsent(self) -> int:
        return int(self._query("SELECT count(*) FROM records WHERE sent_at IS NULL")[0][0])


def now() -> int:
    return int(time.time())


async def early_in_a_second() -> None:
    """Wait until the wall clock is early in its second, so the agent sees a change within that second."""
    await wait_for(lambda: time.time() % 1.0 < 0.4, timeout=2, interval=0.005, message="start of a second")


@pytest.fixture
async def servers() -> AsyncIterator[tuple[FakeKubeApi, FakeControlPlane]]:
    fake = FakeKubeApi()
    await fake.start()
    plane = FakeControlPlane()
    await plane.start()
    yield fake, plane
    plane.release()
    await plane.stop()
    await fake.close()


async def test_sigkill_mid_batch_with_open_sessions(tmp_path: Path,
                                                    servers: tuple[FakeKubeApi, FakeControlPlane]) -> None:
    fake, plane = servers
    spool_path = tmp_path / "spool" / "usage.sqlite3"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REGION_AGENT_REGION": "sfo1", "REGION_AGENT_NODE": NODE,
           "REGION_AGENT_KUBE_URL": fake.url, "REGION_AGENT_USAGE__SPOOL_PATH": str(spool_path),
           "REGION_AGENT_USAGE__ENDPOINT_URL": plane.url, "REGION_AGENT_USAGE__TOKEN": plane.token,
           "REGION_AGENT_USAGE__TOKEN_FILE": "", "REGION_AGENT_USAGE__CHECKPOINT_INTERVAL": str(CHECKPOINT),
           "REGION_AGENT_USAGE__REPORT_INTERVAL": "0.2", "REGION_AGENT_USAGE__BATCH_SIZE": "4",
           "REGION_AGENT_USAGE__REQUEST_TIMEOUT": "60", "REGION_AGENT_USAGE__BACKOFF_INITIAL": "0.1",
           "REGION_AGENT_USAGE__BACKOFF_CAP": "0.5"}
    agent = AgentProcess(env, tmp_path / "agent.log")
    spool = Spool(spool_path)
    expected: dict[str, int] = {}  # pod uid -> seconds it must be billed
    late_ok: set[str] = set()  # pods whose end may be billed up to 1 s late (event after a checkpoint)

    def put(obj: dict[str, Any]) -> None:
        fake.put(PODS, obj)

    t0 = now()
    for name in ("a", "b", "c", "d", "f"):
        put(up(t0, name=name, uid=name, node=NODE))
    put(up(t0, name="elsewhere", uid="elsewhere", node="node-b"))  # another node's agent bills it
    try:
        await agent.start()

        # Short pods churn before the crash; they must come out exact.
        for i in range(4):
            await early_in_a_second()
            start = now()
            put(up(start, name=f"churn-{i}", uid=f"churn-{i}", node=NODE))
            next_second = start + 1
            await wait_for(lambda: now() >= next_second, timeout=3)  # noqa: B023  # awaited right here
            await early_in_a_second()
            end = now()
            put(down(end, name=f"churn-{i}", uid=f"churn-{i}", node=NODE))
            expected[f"churn-{i}"] = end - start
            late_ok.add(f"churn-{i}")

        # f crash-loops (its session closes); c starts graceful deletion (its end becomes known).
        await early_in_a_second()
        f_crash = now()
        put(pod("f", uid="f", node=NODE, statuses=[waiting(restarts=1, last_finished=f_crash), running(t0)]))
        c_end = now() + 1
        put(up(t0, name="c", uid="c", node=NODE, deletion=c_end))
        await wait_for(lambda: spool.ledgers().get("c", {}).get("deletion_at") == c_end
                       and spool.ledgers().get("f", {}).get("session") is None, timeout=5,
                       message="deletion time of c and the crash of f spooled")
        await wait_for(lambda: len(plane.records) >= 8, timeout=10, message="some records delivered")
        await wait_for(lambda: now() >= c_end + 1, timeout=3)

        # Kill it while a POST is in flight (the control plane holds it) and sessions a, b, d are open.
        plane.mode = "hang"
        await wait_for(lambda: plane.in_flight >= 1, timeout=10, message="a batch in flight")
        await agent.kill()
        killed_at = time.time()
        plane.release()
        plane.mode = "ok"
        d_seen = spool.ledgers()["d"]["seen_at"]  # d's last persisted checkpoint: where its bill must end
        assert killed_at - CHECKPOINT - 1 <= d_seen <= killed_at

        # While no agent runs: b finishes (object stays), c and d disappear, e starts.
        await wait_for(lambda: now() >= int(killed_at) + 1, timeout=3)
        b_end = now()
        put(down(b_end, name="b", uid="b", node=NODE))
        fake.delete(PODS, "shop", "c")
        d_gone = now()
        fake.delete(PODS, "shop", "d")
        e_start = now()
        put(up(e_start, name="e", uid="e", node=NODE))
        await wait_for(lambda: now() >= e_start + 1, timeout=3)

        await agent.start()  # same spool: restore, reconcile with the LIST, resend the unacknowledged batch
        await early_in_a_second()
        f_back = now()
        put(pod("f", uid="f", node=NODE, statuses=[running(f_back, restarts=1, last_finished=f_crash),
                                                   running(t0)]))
        await wait_for(lambda: now() >= f_back + 2, timeout=4)
        await early_in_a_second()
        end = now()
        for name in ("a", "e"):
            put(down(end, name=name, uid=name, node=NODE))
        put(pod("f", uid="f", node=NODE, phase="Succeeded", statuses=[
            {"state": {"terminated": {"finishedAt": _ts(end)}}, "restartCount": 1},
            {"state": {"terminated": {"finishedAt": _ts(end)}}, "restartCount": 0}]))

        expected.update({
            "a": end - t0, "b": b_end - t0, "c": c_end - t0, "d": d_seen - t0, "e": end - e_start,
            "f": (f_crash - t0) + (end - f_back),
        })
        late_ok.update({"a", "e", "f"})

        def settled() -> bool:
            billed = plane.seconds_by_pod()
            return (set(billed) == set(expected) and spool.unsent() == 0 and plane.in_flight == 0
                    and all(billed[u] - expected[u] in ((0, 1) if u in late_ok else (0,)) for u in expected))

        try:
            await wait_for(settled, timeout=20, interval=0.05, message="every session billed and acknowledged")
        except AssertionError:
            raise AssertionError(f"billed {plane.seconds_by_pod()} expected {expected} unsent {spool.unsent()} "
                                 f"in flight {plane.in_flight}; agent log {agent.log}") from None
        await agent.terminate()
    finally:
        if agent.proc is not None and agent.proc.returncode is None:
            agent.proc.kill()
            await agent.proc.wait()

    billed = plane.seconds_by_pod()
    assert not plane.conflicts and not plane.malformed and not plane.overlaps()
    for uid, seconds in expected.items():
        slack = billed[uid] - seconds
        assert slack == 0 or (uid in late_ok and slack == 1), (uid, billed[uid], seconds)
    assert "elsewhere" not in billed
    # The designed loss, and only it: d ran until it was deleted, the bill ends at its last checkpoint.
    assert d_gone - d_seen <= CHECKPOINT + 1 + (d_gone - killed_at)
    assert plane.duplicates >= 0 and plane.faults_served.get("hang") == 1


def _ts(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
