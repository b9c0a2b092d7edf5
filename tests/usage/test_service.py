"""The whole usage path in one process: fake apiserver → informer → service → spool → reporter → fake
control plane, on simulated time. Every test ends with the control plane's keys and seconds equal
to the pods' true intervals: nothing lost, nothing counted twice."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from region_agent.usage.spool import Spool
from tests.conftest import wait_for
from tests.usage.harness import Rig, rig, start_service, stop_service


async def churn(r: Rig, rng: random.Random, *, minutes: int, names: list[str], prefix: str) -> None:
    """Random pod lifecycles on the node: starts, crashes and recoveries, finishes, graceful deletes."""
    running: set[str] = set()
    crashed: set[str] = set()
    serial = 0
    for _ in range(minutes * 6):  # one decision every 10 simulated seconds
        roll = rng.random()
        if roll < 0.35 or not running:
            serial += 1
            name = f"{prefix}-{serial}"
            r.node.start(name)
            running.add(name)
            names.append(name)
        elif roll < 0.45 and running - crashed:
            name = rng.choice(sorted(running - crashed))
            r.node.crash(name)
            crashed.add(name)
        elif roll < 0.55 and crashed:
            name = rng.choice(sorted(crashed))
            r.node.recover(name)
            crashed.discard(name)
        elif roll < 0.75:
            name = rng.choice(sorted(running))
            r.node.finish(name, running_now=name not in crashed)
            running.discard(name)
            crashed.discard(name)
        elif roll < 0.85:
            name = rng.choice(sorted(running - crashed) or sorted(running))
            if name in crashed:
                continue
            r.node.begin_delete(name)  # the pod is gone at once: its truth ends now
            r.node.truth.close(r.node.uid(name), r.now)
            await r.sync()
            r.node.remove(name)
            running.discard(name)
        await r.sync()
        await r.advance(10)
    for name in sorted(running):
        r.node.finish(name, running_now=name not in crashed)
    await r.sync()


async def test_churn_under_every_control_plane_fault(tmp_path: Path) -> None:
    async with rig(tmp_path, commit_delay=0.002) as r:  # group commit on: events share transactions
        r.plane.script.extend(["store-drop", "fail-500", "ack-twice", "throttle", "stall", "drop", "ok",
                               "store-500", "unauthorized", "fail-503", "ok", "store-drop", "stall"] * 4)
        for i in range(3):
            r.node.start(f"long-{i}")  # run through the whole test: billed in many checkpoint slices
        names: list[str] = []
        await churn(r, random.Random(4), minutes=20, names=names, prefix="p")
        for i in range(3):
            r.node.finish(f"long-{i}")
        await r.sync()
        await r.advance_until(r.delivered, message="every session delivered")
        r.assert_billed_exactly()
        assert len(names) > 30 and r.node.truth.total > 3 * 1200
        assert r.plane.duplicates > 0, "faults made the agent resend committed batches"
        assert sum(r.plane.faults_served.get(f, 0) for f in ("store-drop", "store-500", "stall")) >= 6
        # Long sessions were billed progressively: more records than sessions.
        assert len(r.plane.records) > r.metric("region_agent_usage_sessions_recorded_total", end_reason="terminated")
        await r.advance(300)  # nothing more arrives later: no late duplicate, no phantom slice
        r.assert_billed_exactly()


async def test_control_plane_outage_of_ten_simulated_minutes(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        names: list[str] = []
        await churn(r, random.Random(11), minutes=3, names=names, prefix="before")
        await r.advance_until(r.delivered, message="records before the outage delivered")
        before = len(r.plane.records)
        written_before = r.metric("region_agent_usage_records_written_total")

        await r.plane.outage()  # connection refused from now on
        outage_start = r.now
        await churn(r, random.Random(12), minutes=10, names=names, prefix="during")
        assert r.now - outage_start >= 600
        assert len(r.plane.records) == before, "nothing can arrive during the outage"
        assert r.metric("region_agent_usage_oldest_unsent_age_seconds") >= 500
        unsent = r.metric("region_agent_usage_spool_unsent_records")
        assert unsent == r.metric("region_agent_usage_records_written_total") - written_before
        assert unsent >= 20  # ten minutes of sessions wait in the spool
        assert r.metric("region_agent_usage_report_errors_total", kind="network") > 5

        await r.plane.recover()  # same port: the agent's next retry gets through
        await r.advance_until(r.delivered, step=5.0, message="backlog delivered after the outage")
        r.assert_billed_exactly()
        assert r.metric("region_agent_usage_oldest_unsent_age_seconds") == 0


async def test_graceful_restart_loses_nothing(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        for i in range(5):
            r.node.start(f"long-{i}")
        await r.sync()
        await r.advance(95)  # one checkpoint at 60 s; 35 s since then are only in memory
        await stop_service(r)  # graceful: checkpoints the open sessions before the spool closes
        r.node.finish("long-0")  # ends while no agent runs; the pod object stays
        await r.advance(30)
        async with ApiClient(Configuration(host=r.fake.url)) as api:
            again = await start_service(r.fake, r.plane, r.clock, r.settings, api, node=r.node)
            try:
                await again.advance(40)
                for i in range(1, 5):
                    again.node.finish(f"long-{i}")
                await again.sync()
                await again.advance_until(again.delivered, message="all sessions delivered")
                again.assert_billed_exactly()
            finally:
                await stop_service(again)
        r.tasks.clear()


async def test_pod_deleted_while_the_watch_was_down_is_closed_by_the_relist(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        r.node.start("stays")
        r.node.start("goes")
        await r.sync()
        await r.advance(70)
        r.node.begin_delete("goes", grace=0)
        await r.sync()
        r.node.truth.close(r.node.uid("goes"), r.now)
        # The watch breaks, the pod disappears, history is compacted: only a relist can tell.
        r.fake.refuse_watches(503)
        r.fake.drop_watches()
        r.node.remove("goes")
        r.fake.expire_history()
        r.fake.refuse_watches(None)
        await wait_for(lambda: "shop/goes" not in r.informer.items, message="relist dropped the pod")
        await r.sync()
        assert r.metric("region_agent_usage_sessions_recorded_total", end_reason="vanished") == 1
        await r.advance(50)
        r.node.finish("stays")
        await r.sync()
        await r.advance_until(r.delivered, message="delivered")
        r.assert_billed_exactly()


async def test_spool_bound_never_drops(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="region_agent.usage")
    async with rig(tmp_path, max_spool_bytes=1024 * 1024, checkpoint_interval=10.0, batch_size=500) as r:
        await r.plane.outage()
        for i in range(150):
            r.node.start(f"pod-{i}")
        await r.sync()
        for _ in range(40):  # one checkpoint at a time, so the spool passes through the warning band
            if r.metric("region_agent_usage_spool_bytes") >= 1024 * 1024:
                break
            await r.advance(10, step=10)
        assert r.metric("region_agent_usage_spool_bytes") >= 1024 * 1024
        assert any("reached its bound" in rec.getMessage() for rec in caplog.records)
        assert any("of its bound" in rec.getMessage() for rec in caplog.records), "loud log before the bound"
        held = r.metric("region_agent_usage_records_written_total")
        await r.advance(100, step=10.0)
        assert r.metric("region_agent_usage_records_written_total") == held, "checkpoints stop cutting records"
        for i in range(0, 150, 2):
            r.node.finish(f"pod-{i}")  # closed sessions are still written, over the bound
        await r.sync()
        assert r.metric("region_agent_usage_records_written_total") == held + 75
        await r.plane.recover()
        for i in range(1, 150, 2):
            r.node.finish(f"pod-{i}")
        await r.sync()
        await r.advance_until(r.delivered, step=10.0, message="everything delivered after the bound")
        r.assert_billed_exactly()


async def test_failed_spool_write_is_retried_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with rig(tmp_path) as r:
        failures = {"left": 3}
        original = Spool.write

        async def flaky(self: Spool, *args: object, **kwargs: object) -> object:
            if failures["left"]:
                failures["left"] -= 1
                raise OSError("disk full")
            return await original(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Spool, "write", flaky)
        r.node.start("a")
        r.node.start("b")
        await r.caught_up()  # the first write fails; the service retries after its backoff (simulated time)
        await r.advance_until(lambda: failures["left"] == 0 and r.service.idle, step=1.0, message="retries done")
        await r.advance(61)
        r.node.finish("a")
        r.node.finish("b")
        await r.sync()
        await r.advance_until(r.delivered, message="delivered")
        r.assert_billed_exactly()
        assert r.metric("region_agent_usage_loop_errors_total", loop="spool") == 3


async def test_stop_during_the_group_commit_window_applies_waiting_events(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        r.service.settings = r.settings.model_copy(update={"commit_delay": 5.0})  # events wait 5 real seconds
        r.node.start("a")
        r.node.start("b")
        await r.caught_up()
        assert not r.service.idle  # the events wait in the group-commit window
        await stop_service(r)  # cancelled inside the window: the waiting events are applied, then checkpointed
        r.tasks.clear()
        spool = Spool(r.settings.spool_path)
        await spool.open(region="sfo1", node="node-a")
        assert {row["identity"]["uid"] for row in await spool.load_ledgers()} == {"uid-a", "uid-b"}
        await spool.close()
        r.clock.advance(100)
        quick = r.settings.model_copy(update={"commit_delay": 0.0})
        async with ApiClient(Configuration(host=r.fake.url)) as api:
            again = await start_service(r.fake, r.plane, r.clock, quick, api, node=r.node)
            try:
                r.node.finish("a")
                r.node.finish("b")
                await again.sync()
                await again.advance_until(again.delivered, message="delivered")
                again.assert_billed_exactly()
            finally:
                await stop_service(again)
