"""Region verdicts laid over the answers: a region the cluster decides is out leaves them.

The verdicts (``region_agent.cluster.quorum``) are recomputed whenever the membership, an observation
or the regions change, and every second (observations age). When the set of regions out of the
answers changes, every copy of those regions gets this agent's observation "region out: <why>"
(``region_agent.state.observations``), which the zone compiler lays over the store: answers change,
the zone serial does not, nothing is replicated. A copy of a region back in loses it. A region
no majority can judge (two regions, no witness) is dropped per project: the project's
``partition`` policy, or the zone's ``cluster.two_region_policy``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from region_agent.cluster.quorum import ClusterView, Policy, Status, Verdict, has_majority, verdicts
from region_agent.state.model import CopyHealth, Kind
from region_agent.state.observations import Observations
from region_agent.state.store import Entry, Store

logger = logging.getLogger("region_agent.cluster")
TICK = 1.0


class ClusterAnswers:
    def __init__(self, *, store: Store, observations: Observations, view: Callable[[], ClusterView],
                 policy: Policy, registry: CollectorRegistry) -> None:
        self.store = store
        self.observations = observations
        self.policy = policy
        self.verdicts: dict[str, Verdict] = {}
        self.out: dict[str, str] = {}     # region → why it is out of the answers
        self.majority = True
        self._view = view
        self._marked: dict[tuple[str, str], str] = {}
        self._pending: asyncio.Handle | None = None
        self._published: tuple[bool, tuple[Verdict, ...]] = (True, ())
        self._judged: dict[str, Verdict] = {}
        self.listeners: list[Callable[[], None]] = []   # told when a verdict or the majority changes
        self._in_answers = Gauge("region_agent_cluster_region_in_answers",
                                 "Whether the cluster's verdict keeps a region in this agent's answers (1) or not (0)",
                                 ["region"], registry=registry)
        self._majority = Gauge("region_agent_cluster_majority",
                               "Whether this agent sees a strict majority of regions alive (writes accepted)",
                               registry=registry)
        store.subscribe(self._on_store_change)

    def request(self) -> None:
        """Recompute on the next loop turn (a burst of events costs one recomputation)."""
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_soon(self._run_pending)

    def _run_pending(self) -> None:
        self._pending = None
        self.recompute()

    def _on_store_change(self, changed: list[Entry]) -> None:
        kinds = {entry.key[0] for entry in changed}
        if kinds & {Kind.REGION.value, Kind.FENCE.value}:
            self.request()
        elif self._judged and Kind.PROJECT.value in kinds:
            self._apply()

    def recompute(self) -> None:
        view = self._view()
        self.verdicts = verdicts(view)
        self.majority = has_majority(view)
        self._majority.set(1 if self.majority else 0)
        out = {region: v.reason for region, v in self.verdicts.items() if not v.in_answers(self.policy)}
        for region in self.verdicts:
            self._in_answers.labels(region).set(0 if region in out else 1)
        if out != self.out or self._published != (self.majority, tuple(self.verdicts.values())):
            self._published = (self.majority, tuple(self.verdicts.values()))
            for listener in list(self.listeners):
                listener()
        if out != self.out:
            for region in sorted(out.keys() - self.out.keys()):
                logger.warning("region %s leaves the answers: %s", region, out[region])
            for region in sorted(self.out.keys() - out.keys()):
                logger.info("region %s is back in the answers (%s)", region, self.verdicts[region].reason
                            if region in self.verdicts else "no longer configured")
            self.out = out
        # Regions some project may drop: out, fenced, or contested (a project's own policy decides).
        judged = {region: v for region, v in self.verdicts.items() if v.status not in (Status.UP, Status.HELD)}
        if judged != self._judged:
            self._judged = judged
            self._apply()

    def describe(self) -> dict[str, object]:
        """For /health/region: the majority and each region's verdict."""
        return {"majority": self.majority,
                "regions": {region: {"status": v.status.value, "in_answers": region not in self.out,
                                     "reason": v.reason} for region, v in sorted(self.verdicts.items())}}

    def _apply(self) -> None:
        wanted: dict[tuple[str, str], str] = {}
        if self._judged:
            for slug, project in self.store.projects.items():
                policy = self.policy if project.partition is None else Policy(project.partition.value)
                for region in project.regions:
                    verdict = self._judged.get(region)
                    if verdict is not None and not verdict.in_answers(policy):
                        wanted[(slug, region)] = f"region out: {verdict.reason}"
        self.observations.forget(sorted(copy for copy in self._marked if copy not in wanted))
        for copy, reason in sorted(wanted.items()):
            if self._marked.get(copy) != reason:
                self.observations.put(copy, CopyHealth(False, reason))
        self._marked = wanted

    async def run(self) -> None:
        """Observations age: look again every second even when nothing arrives."""
        while True:
            self.recompute()
            await asyncio.sleep(TICK)
