"""Session rules as tables: a pod's observed states over time → the slices billed."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from region_agent.usage.pods import metered_pod_from_api
from region_agent.usage.sessions import EndReason, Ledger, SessionBook, Slice
from region_agent.usage.settings import UsageSettings
from tests.usage.factory import down, pod, running, terminated, up, waiting

SETTINGS = UsageSettings()
T = EndReason

# A step: (verb, now, pod object or list of them). Verbs:
#   see       ADDED/MODIFIED with this state          tick      checkpoint (cut slices)
#   hold      checkpoint while the spool is full      delete    DELETED with this final state
#   vanish    DELETED synthesised by a relist (final state unknown; the object is the last known one)
#   restart   the agent restarts: ledgers go through their wire form into a fresh book
#   reconcile the first LIST after a restart found these pods
Step = tuple[str, int, Any]


@dataclass
class Case:
    name: str
    steps: list[Step]
    slices: list[tuple[int, int, bool, EndReason | None]]  # (start, end, final, end_reason)
    open_at_end: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("pending-then-running-then-succeeded", [
        ("see", 100, pod(statuses=None, phase="Pending")),
        ("see", 104, pod(statuses=[waiting(reason="ContainerCreating"), running(103)], phase="Pending")),
        ("see", 106, up(105)),
        ("tick", 160, None),
        ("see", 171, down(170)),
    ], [(105, 160, False, None), (160, 170, True, T.TERMINATED)]),

    Case("readiness-does-not-matter", [
        ("see", 101, pod(statuses=[running(100, ready=False), running(100)], not_ready_since=100)),
        ("see", 120, up(100)),
        ("see", 130, pod(statuses=[running(100, ready=False), running(100)], not_ready_since=129)),
        ("see", 151, down(150)),
    ], [(100, 150, True, T.TERMINATED)]),

    Case("crash-loop-pauses-billing", [
        ("see", 101, up(100)),
        ("see", 150, pod(statuses=[waiting(restarts=1, last_finished=140), running(100)])),
        ("see", 160, pod(statuses=[running(158, restarts=1, last_finished=140), running(100)])),
        ("delete", 201, pod(statuses=[terminated(199, restarts=1), terminated(200)], deletion=230)),
    ], [(100, 140, True, T.CONTAINER_STOPPED), (158, 200, True, T.TERMINATED)]),

    Case("restart-between-two-observations", [
        ("see", 101, up(100)),
        ("see", 200, pod(statuses=[running(150, restarts=1, last_finished=145), running(100)])),
        ("tick", 260, None),
    ], [(100, 145, True, T.RESTARTED), (150, 260, False, None)], open_at_end=True),

    Case("evicted", [
        ("see", 101, up(100)),
        ("see", 131, down(130, phase="Failed", reason="Evicted")),
    ], [(100, 130, True, T.EVICTED)]),

    Case("graceful-delete-known-final-state", [
        ("see", 101, up(100)),
        ("see", 140, up(100, deletion=170)),  # terminating: still running, still billed
        ("tick", 160, None),
        ("delete", 166, pod(phase="Running", statuses=[terminated(163), terminated(165)], deletion=170)),
    ], [(100, 160, False, None), (160, 165, True, T.TERMINATED)]),

    Case("terminating-pod-is-billed-up-to-its-deletion-deadline-at-most", [
        ("see", 101, up(100)),
        ("see", 140, up(100, deletion=150)),  # status keeps saying running (kubelet gone quiet)
        ("tick", 160, None),
        ("tick", 220, None),
        ("delete", 300, up(100, deletion=150)),
    ], [(100, 150, False, None)]),

    Case("force-delete-while-status-says-running", [
        ("see", 101, up(100)),
        ("delete", 185, up(100, deletion=180)),
    ], [(100, 180, True, T.DELETED)]),

    Case("delete-without-deletion-timestamp", [
        ("see", 101, up(100)),
        ("delete", 190, up(100)),
    ], [(100, 190, True, T.DELETED)]),

    Case("vanished-in-relist-ends-at-last-known-time", [
        ("see", 101, up(100)),
        ("tick", 160, None),
        ("vanish", 300, up(100)),
    ], [(100, 160, False, None)]),

    Case("vanished-in-relist-ends-at-seen-deletion-time", [
        ("see", 101, up(100)),
        ("tick", 160, None),
        ("see", 165, up(100, deletion=170)),
        ("vanish", 300, up(100, deletion=170)),
    ], [(100, 160, False, None), (160, 170, True, T.VANISHED)]),

    Case("vanished-but-last-known-state-has-the-end", [
        ("see", 101, up(100)),
        ("see", 151, down(150)),
        ("vanish", 300, down(150)),
    ], [(100, 150, True, T.TERMINATED)]),

    Case("node-lost-pauses-and-resumes-without-gap-or-overlap", [
        ("see", 101, up(100)),
        ("see", 150, pod(phase="Unknown", reason="NodeLost", statuses=[running(100), running(100)],
                         not_ready_since=140)),
        ("see", 200, up(100)),  # the same run is back: it ran all along, billing resumes at 140
        ("see", 251, down(250)),
    ], [(100, 140, True, T.NODE_LOST), (140, 250, True, T.TERMINATED)]),

    Case("node-lost-then-deleted", [
        ("see", 101, up(100)),
        ("see", 150, pod(phase="Unknown", statuses=[running(100), running(100)], not_ready_since=140)),
        ("delete", 500, pod(phase="Unknown", statuses=[running(100), running(100)], deletion=450)),
    ], [(100, 140, True, T.NODE_LOST)]),

    Case("in-place-resize-cuts-a-slice", [
        ("see", 101, up(100)),
        ("see", 130, up(100, requests=[{"cpu": "2", "memory": "1Gi"}, {"cpu": "25m", "memory": "50Mi"}])),
        ("see", 171, down(170)),
    ], [(100, 130, False, None), (130, 170, True, T.TERMINATED)], extra={"sizes": [525, 2025]}),

    Case("end-reported-after-checkpoint-is-clamped", [
        ("see", 101, up(100)),
        ("tick", 160, None),
        ("see", 161, down(155)),  # billed to 160 already: no empty or negative slice
    ], [(100, 160, False, None)]),

    Case("shutdown-ends-at-last-container", [
        ("see", 101, up(100)),
        ("see", 159, pod(statuses=[terminated(150), terminated(158)], deletion=180)),
    ], [(100, 158, True, T.TERMINATED)]),

    Case("one-container-crashes-while-the-other-runs", [
        ("see", 101, up(100)),
        ("see", 159, pod(statuses=[terminated(150), running(100)])),
    ], [(100, 150, True, T.CONTAINER_STOPPED)]),

    Case("running-without-startedAt-starts-at-observation", [
        ("see", 107, pod(statuses=[running(None), running(None)])),
        ("see", 131, down(130)),
    ], [(107, 130, True, T.TERMINATED)]),

    Case("new-run-never-starts-before-billed-time", [
        ("see", 101, up(100)),
        ("tick", 160, None),
        ("see", 161, pod(statuses=[waiting(restarts=1, last_finished=150), running(100)])),
        ("see", 170, pod(statuses=[running(155, restarts=1, last_finished=150), running(100)])),
        ("see", 201, down(200)),
    ], [(100, 160, False, None), (160, 200, True, T.TERMINATED)]),

    Case("start-in-the-future-of-the-agent-clock", [
        ("see", 200, up(205)),
        ("tick", 203, None),
        ("tick", 260, None),
    ], [(205, 260, False, None)], open_at_end=True),

    Case("full-spool-holds-checkpoints-without-losing-time", [
        ("see", 101, up(100)),
        ("hold", 160, None),
        ("hold", 220, None),
        ("tick", 280, None),
    ], [(100, 280, False, None)], open_at_end=True),

    Case("not-all-containers-running-is-no-session", [
        ("see", 101, pod(statuses=[waiting(reason="ContainerCreating"), running(100)])),
        ("see", 130, pod(phase="Succeeded", statuses=[terminated(129), terminated(129)])),
    ], []),

    Case("restart-continues-an-open-session-exactly", [
        ("see", 101, up(100)),
        ("tick", 160, None),
        ("restart", 0, None),
        ("reconcile", 190, [up(100)]),
        ("tick", 220, None),
    ], [(100, 160, False, None), (160, 220, False, None)], open_at_end=True),

    Case("restart-pod-gone-ends-at-last-checkpoint", [
        ("see", 101, up(100)),
        ("tick", 160, None),
        ("restart", 0, None),
        ("reconcile", 400, []),
    ], [(100, 160, False, None)]),

    Case("restart-pod-gone-ends-at-persisted-deletion-time", [
        ("see", 101, up(100)),
        ("see", 120, up(100, deletion=150)),
        ("tick", 140, None),
        ("restart", 0, None),
        ("reconcile", 400, []),
    ], [(100, 140, False, None), (140, 150, True, T.VANISHED)]),

    Case("restart-pod-finished-while-down-ends-exactly", [
        ("see", 101, up(100)),
        ("tick", 160, None),
        ("restart", 0, None),
        ("reconcile", 400, [down(333)]),
    ], [(100, 160, False, None), (160, 333, True, T.TERMINATED)]),

    Case("restart-pod-restarted-while-down", [
        ("see", 101, up(100)),
        ("tick", 160, None),
        ("restart", 0, None),
        ("reconcile", 400, [pod(statuses=[running(300, restarts=1, last_finished=290), running(100)])]),
        ("tick", 460, None),
    ], [(100, 160, False, None), (160, 290, True, T.RESTARTED), (300, 460, False, None)], open_at_end=True),
]


def _apply(book: SessionBook, step: Step) -> tuple[SessionBook, list[Slice]]:
    verb, now, arg = step
    if verb == "see":
        return book, book.observe(metered_pod_from_api(arg, SETTINGS), now).slices
    if verb == "tick":
        return book, book.checkpoint(now).slices
    if verb == "hold":
        return book, book.checkpoint(now, cut=False).slices
    if verb in ("delete", "vanish"):
        last = metered_pod_from_api(arg, SETTINGS) if arg is not None else None
        uid = last.uid if last is not None else next(iter(book.ledgers))
        return book, book.vanish(uid, last, now, final_state_unknown=verb == "vanish").slices
    if verb == "restart":
        fresh = SessionBook()
        fresh.restore(Ledger.from_wire(json.loads(json.dumps(led.to_wire()))) for led in book.ledgers.values())
        return fresh, []
    if verb == "reconcile":
        present = {p.uid: p for p in (metered_pod_from_api(o, SETTINGS) for o in arg)}
        return book, book.reconcile(present, now).slices
    raise AssertionError(verb)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_session_rules(case: Case) -> None:
    book = SessionBook()
    got: list[Slice] = []
    for step in case.steps:
        book, slices = _apply(book, step)
        got.extend(slices)
    assert [(s.start, s.end, s.final, s.end_reason) for s in got] == case.slices
    assert (book.open_sessions == 1) is case.open_at_end
    if "sizes" in case.extra:
        assert [s.size.cpu_millis for s in got] == case.extra["sizes"]


def test_slices_carry_identity_and_size() -> None:
    book = SessionBook()
    obj = up(100, annotations={"autoscaling.knative.dev/min-scale": "2"},
             requests=[{"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"}, {"cpu": "25m", "memory": "50Mi"}])
    book.observe(metered_pod_from_api(obj, SETTINGS), 101)
    (piece,) = book.checkpoint(160).slices
    assert piece.identity.slug == "shop" and piece.identity.revision == "shop-00001"
    assert piece.identity.always_on and piece.identity.min_scale == 2
    assert piece.size.cpu_millis == 1025
    assert piece.size.memory_bytes == 2**30 + 50 * 2**20
    assert piece.size.extended == (("nvidia.com/gpu", 1),)
    assert (piece.session_start, piece.seconds) == (100, 60)


def test_checkpoint_without_open_sessions_writes_nothing() -> None:
    book = SessionBook()
    book.observe(metered_pod_from_api(pod(statuses=None, phase="Pending"), SETTINGS), 100)
    assert not book.checkpoint(160)
    assert not book.ledgers  # a pod that never ran leaves no ledger behind


def test_ledger_wire_round_trip() -> None:
    book = SessionBook()
    book.observe(metered_pod_from_api(up(100, deletion=500), SETTINGS), 101)
    book.checkpoint(160)
    (led,) = book.ledgers.values()
    assert Ledger.from_wire(json.loads(json.dumps(led.to_wire()))) == led


# Invariants under random histories: whatever order states are seen in, with relists, restarts
# and checkpoints mixed in, the slices of a pod never overlap, are never empty, never leave a gap
# inside a session, and stay within the pod's true running time plus the bounded clamping.


def _random_history(rng: random.Random) -> list[Step]:
    steps: list[Step] = []
    now = 1000
    since: int | None = None
    restarts = 0
    alive = True
    book_steps = 0
    while alive and book_steps < 40:
        book_steps += 1
        now += rng.randint(1, 90)
        roll = rng.random()
        if since is None and roll < 0.5:
            since = now - rng.randint(0, 5)
            steps.append(("see", now, up(since)))
        elif since is not None and roll < 0.15:
            finished = now - rng.randint(0, 10)
            restarts += 1
            steps.append(("see", now, pod(statuses=[waiting(restarts=restarts, last_finished=finished),
                                                    running(since)])))
            since = None
        elif since is not None and roll < 0.25:
            finished = now - rng.randint(0, 5)
            restarts += 1
            since = now - rng.randint(0, 3)
            steps.append(("see", now, pod(statuses=[running(since, restarts=restarts, last_finished=finished),
                                                    running(since)])))
        elif roll < 0.55:
            steps.append(("tick", now, None))
        elif roll < 0.6:
            steps.append(("hold", now, None))
        elif roll < 0.7:
            steps.append(("restart", 0, None))
            state = up(since) if since is not None else pod(statuses=[waiting(restarts=restarts), running(1000)])
            steps.append(("reconcile", now, [state]))
        elif roll < 0.73:
            steps.append(("see", now, pod(phase="Unknown", statuses=[running(since or now), running(since or now)],
                                          not_ready_since=now - rng.randint(0, 30))))
        elif roll < 0.78:
            alive = False
            verb = rng.choice(["delete", "vanish"])
            steps.append((verb, now, up(since or 1000, deletion=now - rng.randint(0, 20))))
    return steps


@pytest.mark.parametrize("seed", range(200))
def test_invariants_under_random_histories(seed: int) -> None:
    rng = random.Random(seed)
    book = SessionBook()
    got: list[Slice] = []
    for step in _random_history(rng):
        book, slices = _apply(book, step)
        got.extend(slices)
    starts = [s.start for s in got]
    assert len(set(starts)) == len(starts), "slice starts (and so keys) are unique per pod"
    for a, b in itertools.pairwise(got):
        assert a.end <= b.start, "slices of one pod never overlap and are in order"
        if a.session_start == b.session_start:
            assert a.end == b.start, "no gap inside a session"
            assert not a.final
    assert all(s.end > s.start for s in got), "no empty slice"
