"""SIGKILL ``region-agent run`` in the middle of a POST, several times, restart it, check the bill.

The real product, started as the operator starts it: ``region-agent run --config agent.yaml`` in
Kubernetes mode, its kubeconfig pointing at the fake apiserver of this test and its usage endpoint
at the fake control plane, over loopback, in real time. Kubernetes timestamps are whole seconds,
which is the billing granularity: a session's end may be billed up to 1 s late when the pod's final
state reaches the agent after a checkpoint already billed that second (the rule in
``region_agent.usage.sessions``: billed seconds are never taken back). Every other second is exact,
including sessions that were open across a crash. The one designed loss is asserted exactly: a pod
that vanished while the agent was dead, without a deletion time the agent had seen, is billed up
to its last persisted checkpoint (at most one checkpoint interval before the kill).

The first kill hits a POST the control plane holds (nothing stored); the later ones hit a POST the
control plane stores after the agent died, so the restarted agent sends committed records again
and the idempotency keys must deduplicate them.
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

from region_agent.kube.resources import PODS
from tests.conftest import wait_for
from tests.fakes.control_plane import FakeControlPlane
from tests.fakes.kube_api import FakeKubeApi
from tests.usage.factory import down, pod, running, up, waiting

ROOT = Path(__file__).resolve().parents[2]
NODE = "node-a"
CHECKPOINT = 1.0
STALL = 1.5  # the control plane stores a stalled batch this long after it arrived: the agent is dead by then
COMMAND = Path(sys.executable).with_name("region-agent")  # the console script the package installs


def write_config(tmp_path: Path, kube_url: str, plane: FakeControlPlane) -> Path:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": kube_url}}],
        "users": [{"name": "agent", "user": {"token": "test-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
    }))
    config = tmp_path / "agent.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "region": "sfo1", "node": NODE, "kubernetes": True, "log_level": "info",
        "dns": {"zone": "g.example.com", "listen_addresses": ["127.0.0.1"], "port": 0},
        "health": {"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0},
        "kube": {"config": "kubeconfig", "kubeconfig": str(kubeconfig), "node_name": NODE,
                 "cnpg": {"enabled": False},
                 "watch": {"backoff_initial": 0.05, "backoff_cap": 0.5, "very_short_watch": 0.0}},
        "usage": {"spool_path": str(tmp_path / "spool" / "usage.sqlite3"), "endpoint_url": plane.url,
                  "token": plane.token, "token_file": None, "checkpoint_interval": CHECKPOINT,
                  "report_interval": 0.2, "batch_size": 4, "request_timeout": 60, "backoff_initial": 0.1,
                  "backoff_cap": 0.5},
    }))
    return config


class AgentProcess:
    """``region-agent run`` as a child process; its JSON log lines go to one file across restarts."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config = config
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    def _reconciled(self) -> int:
        if not self.log.exists():
            return 0
        return sum(1 for line in self.log.read_text(errors="replace").splitlines() if "usage reconciled" in line)

    async def start(self) -> None:
        self.starts += 1
        out = self.log.open("ab")  # a local file, opened once per start
        try:
            self.proc = await asyncio.create_subprocess_exec(
                str(COMMAND), "run", "--config", str(self.config), cwd=ROOT, stdout=out, stderr=out,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
        finally:
            out.close()  # the child holds its own descriptor
        proc = self.proc
        await wait_for(lambda: self._reconciled() >= self.starts or proc.returncode is not None, timeout=30,
                       interval=0.05, message=f"usage reconciled in the agent (log {self.log})")
        assert proc.returncode is None, f"region-agent run exited {proc.returncode}; see {self.log}"

    async def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        assert await self.proc.wait() == -signal.SIGKILL

    async def terminate(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(self.proc.wait(), timeout=30) == 0


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
    plane = FakeControlPlane(stall_for=STALL)
    await plane.start()
    yield fake, plane
    plane.release()
    await plane.stop()
    await fake.close()


async def test_sigkill_mid_post_with_open_sessions(tmp_path: Path,
                                                   servers: tuple[FakeKubeApi, FakeControlPlane]) -> None:
    fake, plane = servers
    agent = AgentProcess(write_config(tmp_path, fake.url, plane), tmp_path / "agent.log")
    spool = Spool(tmp_path / "spool" / "usage.sqlite3")
    expected: dict[str, int] = {}  # pod uid -> seconds it must be billed
    late_ok: set[str] = set()  # pods whose end may be billed up to 1 s late (event after a checkpoint)

    def put(obj: dict[str, Any]) -> None:
        fake.put(PODS, obj)

    async def kill_mid_post(fault: str) -> float:
        """Kill the agent while a POST is in flight (held by the control plane per ``fault``)."""
        plane.mode = fault
        await wait_for(lambda: plane.in_flight >= 1, timeout=10, message="a batch in flight")
        await agent.kill()
        killed = time.time()
        plane.release()
        await wait_for(lambda: plane.in_flight == 0, timeout=STALL + 5, message="the held POST finished")
        plane.mode = "ok"
        return killed

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

        # Kill 1: the control plane holds the POST and stores nothing; sessions a, b, d are open.
        killed_at = await kill_mid_post("hang")
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

        # Kills 2-4: the control plane stores the batch after the agent died; the restarted agent sends
        # it again. Meanwhile pods end with their objects kept and new ones start: all billed exactly.
        g_starts: list[int] = []
        for i in range(3):
            killed = await kill_mid_post("stall")
            await wait_for(lambda: now() >= int(killed) + 1, timeout=3)  # noqa: B023  # awaited right here
            if i > 0:  # the previous g pod ends while no agent runs; its object stays
                g_end = now()
                put(down(g_end, name=f"g-{i - 1}", uid=f"g-{i - 1}", node=NODE))
                expected[f"g-{i - 1}"] = g_end - g_starts[i - 1]
            g_starts.append(now())
            put(up(g_starts[-1], name=f"g-{i}", uid=f"g-{i}", node=NODE))
            await agent.start()
            await wait_for(lambda: now() >= g_starts[-1] + 2, timeout=4)

        await early_in_a_second()
        end = now()
        for name in ("a", "e", "g-2"):
            put(down(end, name=name, uid=name, node=NODE))
        put(pod("f", uid="f", node=NODE, phase="Succeeded", statuses=[
            {"state": {"terminated": {"finishedAt": _ts(end)}}, "restartCount": 1},
            {"state": {"terminated": {"finishedAt": _ts(end)}}, "restartCount": 0}]))

        expected.update({
            "a": end - t0, "b": b_end - t0, "c": c_end - t0, "d": d_seen - t0, "e": end - e_start,
            "f": (f_crash - t0) + (end - f_back), "g-2": end - g_starts[2],
        })
        late_ok.update({"a", "e", "f", "g-2"})

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

    billed = plane.seconds_by_pod()  # again after the graceful stop, which must not have added anything
    assert not plane.conflicts and not plane.malformed and not plane.overlaps()
    for uid, seconds in expected.items():
        slack = billed[uid] - seconds
        assert slack == 0 or (uid in late_ok and slack == 1), (uid, billed[uid], seconds)
    assert "elsewhere" not in billed
    # The designed loss, and only it: d ran until it was deleted, the bill ends at its last checkpoint.
    assert d_gone - d_seen <= CHECKPOINT + 1 + (d_gone - killed_at)
    assert plane.faults_served.get("hang") == 1 and plane.faults_served.get("stall") == 3
    # Each stalled batch was stored after its agent died and sent again by the next one.
    assert plane.duplicates >= 3, plane.duplicates


def _ts(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
