"""Usage sessions from pod states: pure rules, no I/O, no clock of their own.

A **session** is a maximal interval during which a pod on this node is *running*: phase
``Running`` and every regular container in state ``running``. Readiness does not matter (a
starting or unready pod holds its requests on the node), a crash-looping container does (the
pod is not running while one of its containers waits to restart). Sessions are billed
progressively as **slices** ``[start, end)`` in whole seconds; every slice becomes one usage
record whose idempotency key is derived from ``(region, pod uid, slice start)``.

Invariants the whole design rests on, enforced here and nowhere else:

* Per pod, a *ledger* keeps ``billed_to``: every second before it is either in a slice already
  or was not running. A slice always starts at ``billed_to`` and ``billed_to`` only grows, so the
  slices of one pod never overlap and never leave a gap inside a session. A new session starts
  at ``max(its run start, billed_to)``: a pod that comes back after a node-lost pause continues
  where billing stopped instead of being billed twice.
* No slice is empty, so slice starts are unique per pod and so are the keys.
* Times only come from the pod (``startedAt``, ``finishedAt``, ``deletionTimestamp``) or from
  the caller's ``now``; an end is clamped into ``[billed_to, now]`` because seconds already
  billed can not be taken back (the over-billing this allows is bounded by the event delay).
  Nothing is billed past a pod's ``deletionTimestamp`` (the end of its grace period).

The methods return a :class:`Change` (slices to spool and ledger rows to write, atomically) and
keep the in-memory ledgers in step; the caller persists the change before anything is reported.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from region_agent.usage.pods import MeteredPod, PodIdentity, Size


class EndReason(enum.StrEnum):
    """Why a session ended; part of the wire format (informational, never used for pricing)."""

    TERMINATED = "terminated"  # the pod finished: Succeeded/Failed, or its containers stopped during deletion
    EVICTED = "evicted"  # phase Failed, reason Evicted (node pressure, API eviction)
    NODE_LOST = "node-lost"  # phase Unknown / reason NodeLost: billing pauses until the pod is seen again
    CONTAINER_STOPPED = "container-stopped"  # a container crashed or waits to restart; the pod lives on
    RESTARTED = "restarted"  # a container restarted between two observations; a new session follows at once
    DELETED = "deleted"  # the pod object was deleted while its last status still said running
    VANISHED = "vanished"  # the pod disappeared while the agent could not see it (relist or agent down)


@dataclass(frozen=True, slots=True)
class Run:
    """One uninterrupted run of every container of a pod; a restart of any container makes a new one."""

    since: int | None  # when the last container came up (latest startedAt); None if the runtime omitted it
    restarts: int  # sum of the containers' restart counts


@dataclass(frozen=True, slots=True)
class OpenSession:
    start: int  # first billed second of the session (>= the pod's billed_to when it opened)
    run: Run
    size: Size


@dataclass(frozen=True, slots=True)
class Ledger:
    """Everything metering remembers about one pod that has run on this node; one spool row."""

    identity: PodIdentity
    billed_to: int  # high-water mark: every second before it is in a slice or was not running
    seen_at: int  # the last instant the pod was known to be running (last event or checkpoint)
    deletion_at: int | None = None
    session: OpenSession | None = None

    def to_wire(self) -> dict[str, Any]:
        session = None
        if self.session is not None:
            s = self.session
            session = {"start": s.start, "run_since": s.run.since, "restarts": s.run.restarts,
                       "size": s.size.to_wire()}
        return {"identity": self.identity.to_wire(), "billed_to": self.billed_to, "seen_at": self.seen_at,
                "deletion_at": self.deletion_at, "session": session}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Ledger:
        raw = data.get("session")
        session = None
        if raw is not None:
            session = OpenSession(int(raw["start"]), Run(raw.get("run_since"), int(raw["restarts"])),
                                  Size.from_wire(raw["size"]))
        deletion = data.get("deletion_at")
        return cls(PodIdentity.from_wire(data["identity"]), int(data["billed_to"]), int(data["seen_at"]),
                   None if deletion is None else int(deletion), session)


@dataclass(frozen=True, slots=True)
class Slice:
    """One billed piece of a session: ``[start, end)`` at one size. Becomes one usage record."""

    identity: PodIdentity
    size: Size
    session_start: int
    start: int
    end: int
    final: bool = False  # this slice ends the session (absent when the end fell on a checkpoint)
    end_reason: EndReason | None = None

    @property
    def seconds(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class Change:
    """What one or more calls decided: slices to spool and ledger rows to put (None: delete)."""

    slices: list[Slice] = field(default_factory=list)
    ledgers: dict[str, Ledger | None] = field(default_factory=dict)
    opened: int = 0
    closed: list[EndReason] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.slices or self.ledgers)

    def extend(self, other: Change) -> None:
        self.slices.extend(other.slices)
        self.ledgers.update(other.ledgers)
        self.opened += other.opened
        self.closed.extend(other.closed)


def run_of(pod: MeteredPod) -> Run | None:
    """The pod's current run if it is running (phase Running, every regular container running)."""
    if pod.phase != "Running" or not pod.containers or not all(c.running for c in pod.containers):
        return None
    starts = [c.running_since for c in pod.containers if c.running_since is not None]
    return Run(max(starts) if starts else None, sum(c.restarts for c in pod.containers))


def end_of_run(pod: MeteredPod, session: OpenSession) -> tuple[int | None, EndReason]:
    """When and why the session's run ended, as far as the pod's status says.

    The time is None when the status holds no instant for it (the caller falls back to the
    observation time, the deletion time or the last known time). With containers still running
    the run ended when the first one stopped; with none running, when the last one did (the
    pod released its requests then).
    """
    if pod.phase == "Unknown" or pod.reason == "NodeLost":
        return pod.not_ready_since, EndReason.NODE_LOST
    since = session.run.since if session.run.since is not None else session.start
    stops = [t for c in pod.containers for t in (c.terminated_at, c.last_terminated_at)
             if t is not None and t >= since]
    any_running = any(c.running for c in pod.containers)
    end = (min(stops) if any_running else max(stops)) if stops else None
    if pod.phase == "Failed" and pod.reason == "Evicted":
        reason = EndReason.EVICTED
    elif pod.phase in ("Succeeded", "Failed") or (pod.deletion_at is not None and not any_running):
        reason = EndReason.TERMINATED
    elif run_of(pod) is not None:
        reason = EndReason.RESTARTED
    else:
        reason = EndReason.CONTAINER_STOPPED
    return end, reason


class SessionBook:
    """The ledgers of all pods on this node and the rules that move them. Not thread-safe: one owner."""

    def __init__(self) -> None:
        self._ledgers: dict[str, Ledger] = {}
        self._open: set[str] = set()  # uids with an open session (kept in step by _put/_pop)

    @property
    def ledgers(self) -> Mapping[str, Ledger]:
        return self._ledgers

    @property
    def open_sessions(self) -> int:
        return len(self._open)

    def restore(self, ledgers: Iterable[Ledger]) -> None:
        """Load the ledgers persisted by an earlier process (before any event is applied)."""
        for led in ledgers:
            self._put(led)

    def _put(self, led: Ledger) -> None:
        uid = led.identity.uid
        self._ledgers[uid] = led
        if led.session is None:
            self._open.discard(uid)
        else:
            self._open.add(uid)

    def _pop(self, uid: str) -> Ledger | None:
        self._open.discard(uid)
        return self._ledgers.pop(uid, None)

    def observe(self, pod: MeteredPod, now: int) -> Change:
        """Apply the pod's current state (ADDED or MODIFIED, or found by a relist or at start)."""
        change = Change()
        led = self._ledgers.get(pod.uid)
        run = run_of(pod)
        if led is None:
            if run is None:
                return change  # never ran here: nothing to remember
            led = Ledger(pod.identity, billed_to=0, seen_at=now)
            change.ledgers[pod.uid] = led
        if pod.deletion_at is not None and led.deletion_at != pod.deletion_at:
            led = replace(led, deletion_at=pod.deletion_at)
            change.ledgers[pod.uid] = led
        session = led.session
        if session is not None:
            if run is not None and run == session.run:
                led = replace(led, seen_at=max(led.seen_at, now))
                if pod.size != session.size:  # in-place resize: bill the old size up to now
                    led = self._cut(led, now, change, size=pod.size)
            else:
                end, reason = end_of_run(pod, session)
                led = self._close(led, now if end is None else end, reason, now, change)
        if led.session is None and run is not None:
            start = max(now if run.since is None else run.since, led.billed_to)
            led = replace(led, billed_to=start, seen_at=max(led.seen_at, now),
                          session=OpenSession(start, run, pod.size))
            change.ledgers[pod.uid] = led
            change.opened += 1
        self._put(led)
        return change

    def vanish(self, uid: str, last: MeteredPod | None, now: int, *, final_state_unknown: bool) -> Change:
        """The pod is gone: DELETED (``last`` is its final state), or a relist or restart found it missing.

        With the final state unknown, an open session ends at the deletion time if one was seen,
        else at the last instant the pod was known to be running, never later: billing only what
        was observed.
        """
        change = Change()
        led = self._pop(uid)
        if led is None:
            return change
        change.ledgers[uid] = None
        if led.session is not None:
            deletion = led.deletion_at
            if last is not None and last.deletion_at is not None:
                deletion = last.deletion_at
            if final_state_unknown:
                fallback, reason = (led.seen_at if deletion is None else deletion), EndReason.VANISHED
            else:
                fallback, reason = (now if deletion is None else min(deletion, now)), EndReason.DELETED
            end: int | None = None
            if last is not None:
                end, known_reason = end_of_run(last, led.session)
                if end is not None:
                    reason = known_reason
            self._close(led, fallback if end is None else end, reason, now, change)
            change.ledgers[uid] = None
        return change

    def checkpoint(self, now: int, *, cut: bool = True) -> Change:
        """Bill every open session up to ``now`` (``cut=False``: only remember that they ran until now)."""
        change = Change()
        for uid in sorted(self._open):
            before = self._ledgers[uid]
            led = replace(before, seen_at=max(before.seen_at, now))
            if cut:
                led = self._cut(led, now, change)
            self._put(led)
            change.ledgers[uid] = led
        return change

    def reconcile(self, present: Mapping[str, MeteredPod], now: int) -> Change:
        """After a (re)start: close pods that vanished while the agent was away, observe the rest.

        ``present`` maps pod uid to the pods the first full LIST returned.
        """
        change = Change()
        for uid in [uid for uid in self._ledgers if uid not in present]:
            change.extend(self.vanish(uid, None, now, final_state_unknown=True))
        for pod in present.values():
            change.extend(self.observe(pod, now))
        return change

    # The two ways a slice is made.

    def _cut(self, led: Ledger, now: int, change: Change, *, size: Size | None = None) -> Ledger:
        session = led.session
        assert session is not None
        until = _billable_until(led, now)
        if until > led.billed_to:
            change.slices.append(Slice(led.identity, session.size, session.start, led.billed_to, until))
            led = replace(led, billed_to=until)
        if size is not None:
            led = replace(led, session=replace(session, size=size))
        change.ledgers[led.identity.uid] = led
        return led

    def _close(self, led: Ledger, end: int, reason: EndReason, now: int, change: Change) -> Ledger:
        session = led.session
        assert session is not None
        end = max(led.billed_to, min(end, _billable_until(led, now)))
        if end > led.billed_to:
            change.slices.append(Slice(led.identity, session.size, session.start, led.billed_to, end,
                                       final=True, end_reason=reason))
        led = replace(led, billed_to=end, session=None)
        change.ledgers[led.identity.uid] = led
        change.closed.append(reason)
        return led


def _billable_until(led: Ledger, now: int) -> int:
    """Billing never runs ahead of ``now``, nor past the pod's deletion deadline.

    ``deletionTimestamp`` is the end of the grace period: the kubelet has killed the containers
    by then, so a status still saying "running" after it is stale (a lost node, a kubelet that
    stopped reporting) and the time after it is not billed.
    """
    return now if led.deletion_at is None else min(now, led.deletion_at)
