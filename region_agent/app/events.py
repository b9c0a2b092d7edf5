"""Recent transitions this agent saw, in a bounded ring: what the operator status page lists.

:class:`EventRing` keeps the last :data:`CAPACITY` events in memory (nothing is persisted; a
restart starts an empty ring). :class:`EventFeed` turns what changes into events, each hook
O(what changed) and never blocking:

- the cluster's verdicts (:class:`~region_agent.cluster.answers.ClusterAnswers` listeners): a
  region leaving or re-entering the answers, its status changing (up, out, fenced, contested,
  held), the majority lost or regained;
- the membership (gossip member listeners): a member joining, suspected, dead, left;
- the store: fences set and lifted, copies turning healthy or unhealthy (at most
  :data:`COPIES_PER_BATCH` events per batch of changes, then one line counting the rest, so a
  sync of 10,000 copies costs a handful of events, not 10,000).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from region_agent.state.model import CopyHealth, Fence, Kind
from region_agent.state.store import Entry

if TYPE_CHECKING:
    from region_agent.cluster.answers import ClusterAnswers
    from region_agent.gossip.membership import MemberView
    from region_agent.gossip.messages import State

__all__ = ["CAPACITY", "COPIES_PER_BATCH", "Event", "EventFeed", "EventRing"]

CAPACITY = 100
COPIES_PER_BATCH = 5


@dataclass(frozen=True, slots=True)
class Event:
    at: float       # wall-clock seconds
    kind: str       # region-out, region-in, region-status, majority-lost, majority-regained, member-*, fence,
                    # unfence, copy-down, copy-up, copies
    subject: str    # the region, member or copy (slug/region) it is about
    text: str       # one line for a person

    def to_dict(self) -> dict[str, object]:
        return {"at": self.at, "kind": self.kind, "subject": self.subject, "text": self.text}


class EventRing:
    """The last ``capacity`` events; ``total`` counts every event ever added (a cheap change key)."""

    def __init__(self, capacity: int = CAPACITY, *, wall: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError("an event ring holds at least one event")
        self._events: deque[Event] = deque(maxlen=capacity)
        self._wall = wall
        self.capacity = capacity
        self.total = 0

    def add(self, kind: str, subject: str, text: str) -> Event:
        event = Event(self._wall(), kind, subject, text)
        self._events.append(event)
        self.total += 1
        return event

    def recent(self) -> list[Event]:
        """Newest first."""
        return list(reversed(self._events))

    def __len__(self) -> int:
        return len(self._events)


class EventFeed:
    """Feeds an :class:`EventRing` from the store, the verdicts and the membership."""

    def __init__(self, ring: EventRing) -> None:
        self.ring = ring
        self._regions: dict[str, tuple[str, bool]] = {}   # region → (status, in the answers), as last told
        self._majority: bool | None = None

    def follow_cluster(self, answers: ClusterAnswers,
                       member_listeners: list[Callable[[MemberView, State | None], None]]) -> None:
        """Hear the verdicts and the membership of a cluster from now on."""
        answers.listeners.append(lambda: self.verdicts_changed(answers))
        member_listeners.append(self.member_changed)

    # --- store ---------------------------------------------------------------------------------

    def store_changed(self, changed: list[Entry]) -> None:
        copies = 0
        for entry in changed:
            kind = entry.key[0]
            if kind == Kind.FENCE.value and len(entry.key) > 1:
                region, value = entry.key[1], entry.value
                if isinstance(value, Fence):
                    self.ring.add("fence", region, f"region {region} fenced: {value.reason or 'no reason given'}")
                elif value is None:
                    self.ring.add("unfence", region, f"region {region} unfenced")
            elif kind == Kind.COPY.value and len(entry.key) > 2:
                copies += 1
                if copies > COPIES_PER_BATCH:
                    continue
                subject = f"{entry.key[1]}/{entry.key[2]}"
                value = entry.value
                if isinstance(value, CopyHealth):
                    if value.healthy:
                        self.ring.add("copy-up", subject, f"copy {subject} healthy")
                    else:
                        self.ring.add("copy-down", subject, f"copy {subject} unhealthy: {value.reason}")
                elif value is None:
                    self.ring.add("copy-gone", subject, f"copy {subject} no longer reported")
        if copies > COPIES_PER_BATCH:
            more = copies - COPIES_PER_BATCH
            self.ring.add("copies", "", f"{more} more copy health change{'s' if more != 1 else ''} in the same batch")

    # --- verdicts ------------------------------------------------------------------------------

    def verdicts_changed(self, answers: ClusterAnswers) -> None:
        """A :class:`ClusterAnswers` listener (called before ``answers.out`` is updated: read the verdicts)."""
        if answers.majority != self._majority:
            if self._majority is not None or not answers.majority:
                if answers.majority:
                    self.ring.add("majority-regained", "", "this agent sees a majority of regions again")
                else:
                    self.ring.add("majority-lost", "", "this agent no longer sees a majority of regions: "
                                  "writes refused, nobody removed")
            self._majority = answers.majority
        seen: dict[str, tuple[str, bool]] = {}
        for region, verdict in sorted(answers.verdicts.items()):
            now = (verdict.status.value, verdict.in_answers(answers.policy))
            seen[region] = now
            before = self._regions.get(region)
            if before == now:
                continue
            status, inside = now
            if before is None:
                if status == "up" and inside:
                    continue   # the usual start: not a transition
                kind = "region-in" if inside else "region-out"
            elif before[1] != inside:
                kind = "region-in" if inside else "region-out"
            else:
                kind = "region-status"
            where = "in the answers" if inside else "out of the answers"
            was = "" if before is None else f" (was {before[0]})"
            self.ring.add(kind, region, f"region {region} {status}{was}, {where}: {verdict.reason}")
        for region in sorted(self._regions.keys() - seen.keys()):
            self.ring.add("region-status", region, f"region {region} no longer configured")
        self._regions = seen

    # --- membership ----------------------------------------------------------------------------

    def member_changed(self, view: MemberView, previous: State | None) -> None:
        if previous is view.state:
            return   # a refreshed record (metadata, incarnation), not a transition
        state = view.state.name.lower()
        member = view.member
        if state in ("dead", "left"):
            kind = "member-lost"
        elif state == "suspect":
            kind = "member-suspect"
        else:
            kind = "member-alive"
        was = "new" if previous is None else previous.name.lower()
        self.ring.add(kind, member.name, f"member {member.name} ({member.region}) {was} -> {state}")
