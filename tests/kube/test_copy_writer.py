"""This region's copy health from the watch into the store: one batch per change, and the first sync
reconciles every copy of this region the store holds."""

from __future__ import annotations

import time
from typing import cast

from region_agent.kube.copy_writer import LocalCopyWriter
from region_agent.kube.sources import KubeSources
from region_agent.state.hlc import HybridClock
from region_agent.state.local import CopyReason, CopyStatus
from region_agent.state.model import CopyHealth, copy_key
from region_agent.state.store import Store


def _store() -> Store:
    store = Store(writer="sfo1/n1", clock=HybridClock(lambda: int(time.time() * 1000)))
    # What the store holds from before a restart: two of this region's copies, one of another region's.
    store.put(copy_key("shop", "sfo1"), CopyHealth(True))
    store.put(copy_key("blog", "sfo1"), CopyHealth(True))
    store.put_many([(copy_key("shop", "ams1"), CopyHealth(True))], writer="ams1/n1")
    return store


def _ok(slug: str) -> CopyStatus:
    return CopyStatus(slug, True, CopyReason.OK, "")


async def test_a_service_deleted_while_the_agent_was_down_is_not_found_at_the_first_sync() -> None:
    store = _store()
    writer = LocalCopyWriter(cast(KubeSources, None), store, "sfo1")   # write() needs no Kubernetes
    await writer.write({"blog": _ok("blog")})
    assert store.copies[("shop", "sfo1")] == CopyHealth(False, "not-found")
    assert store.copies[("blog", "sfo1")].healthy
    assert store.copies[("shop", "ams1")].healthy                          # another region's: not ours to say
    writer.synced.set()
    # Later syncs only follow what the watch had: a slug written healthy by someone else is left alone.
    store.put(copy_key("docs", "sfo1"), CopyHealth(True))
    heard: list[int] = []
    store.subscribe(lambda changes: heard.append(len(changes)))
    await writer.write({"blog": _ok("blog")})
    assert store.copies[("docs", "sfo1")].healthy and heard == []          # unchanged: no new versions
