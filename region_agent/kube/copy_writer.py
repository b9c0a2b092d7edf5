"""This region's copy health, from the Knative watch cache into the replicated store.

In Kubernetes mode the watch is the only judge of this region's copies (never an HTTP check):
on every change :class:`LocalCopyWriter` takes a :class:`~region_agent.kube.sources.KubeSnapshot`
and writes every copy as one batch, owned by this region, so the zone compiler and gossip hear
once per change; unchanged copies make no new version, and a first sync of 10,000 copies goes to
anti-entropy rather than 10,000 broadcasts. Before the first LIST nothing is written: unknown is
not unhealthy. A slug that leaves the watch is written ``not-found``, and so, at the first sync,
is every copy of this region the store still reports and the watch does not have: a Service
deleted while the agent was down (or while the region had no agent) does not stay healthy forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from region_agent.kube.sources import KubeSnapshot, KubeSources
from region_agent.state.local import CopyStatus
from region_agent.state.model import CopyHealth, copy_key
from region_agent.state.store import Store, put_many_off_loop

SnapshotListener = Callable[[KubeSnapshot], None]


class LocalCopyWriter:
    def __init__(self, kube: KubeSources, store: Store, region: str) -> None:
        self.kube = kube
        self.store = store
        self.region = region
        self.synced = asyncio.Event()      # set after the first write from a synced watch
        self.last: KubeSnapshot | None = None
        self.listeners: list[SnapshotListener] = []   # called with every snapshot, after the write
        self._written: set[str] = set()

    def snapshot(self) -> KubeSnapshot:
        """The last snapshot taken, or a fresh one before the first change."""
        return self.last if self.last is not None else self.kube.view()

    async def write(self, copies: dict[str, CopyStatus]) -> None:
        items = [(copy_key(slug, self.region), CopyHealth(status.healthy, status.reason.value))
                 for slug, status in copies.items()]
        gone = self._written - copies.keys()
        if not self.synced.is_set():   # the first sync: whatever the store holds for this region, too
            gone |= {slug for (slug, region), health in self.store.copies.items()
                     if region == self.region and health.reason != "not-found"} - copies.keys()
        items += [(copy_key(slug, self.region), CopyHealth(False, "not-found")) for slug in sorted(gone)]
        self._written = set(copies)
        await put_many_off_loop(self.store, items)

    async def run(self) -> None:
        while True:
            await self.kube.changed.wait()
            self.kube.changed.clear()
            snap = self.last = self.kube.view()
            if snap.synced:
                await self.write(snap.copies)
                self.synced.set()
            for listener in self.listeners:
                listener(snap)
