"""A region with no agent left alive in the membership: its copies leave this agent's answers.

A region's copy health is written by that region's agents; when every one of them is dead (kill
-9, a power cut, the region's network gone), nobody is left to say its copies stopped serving,
and the last report would stand forever. So this agent lays an observation over those copies,
"region-down", as soon as the membership declares the region's last agent dead (the SWIM
suspicion timeout: seconds), and lifts it when an agent of the region is alive again.

Only regions seen alive at least once count: at start, before the first join, every other region
is unknown, not down. The agent's own region is never down to itself. Observations change
answers, never the zone serial (like PowerDNS's ``ifurlup``), and are never replicated.

This is one vantage point's view: a partition between two regions makes each drop the other.
Deciding region liveness by a quorum of regions replaces it (issue 10).
"""

from __future__ import annotations

import logging

from agent.state.model import CopyHealth, Kind
from agent.state.observations import Observations
from agent.state.store import Entry, Store

logger = logging.getLogger("region_agent.gossip")

REASON = "region-down: no agent of the region is alive in the gossip membership"


class RegionLiveness:
    def __init__(self, store: Store, observations: Observations, own_region: str) -> None:
        self.store = store
        self.observations = observations
        self.own_region = own_region
        self.seen: set[str] = set()
        self.down: frozenset[str] = frozenset()
        self._marked: set[tuple[str, str]] = set()
        store.subscribe(self._on_store_change)

    def update(self, alive: set[str]) -> None:
        """The regions with an agent alive or suspect now."""
        self.seen |= alive
        down = frozenset(self.seen - alive - {self.own_region})
        if down != self.down:
            for region in sorted(down - self.down):
                logger.warning("region %s: no agent alive; its copies leave the answers", region)
            for region in sorted(self.down - down):
                logger.info("region %s: an agent is alive again", region)
            self.down = down
            self._apply()

    def _on_store_change(self, changed: list[Entry]) -> None:
        if self.down and any(entry.key[0] == Kind.PROJECT.value for entry in changed):
            self._apply()

    def _apply(self) -> None:
        wanted = {(slug, region) for slug, project in self.store.projects.items()
                  for region in project.regions if region in self.down}
        self.observations.forget(sorted(self._marked - wanted))
        for copy in sorted(wanted - self._marked):
            self.observations.put(copy, CopyHealth(False, REASON))
        self._marked = wanted
