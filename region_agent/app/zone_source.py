"""The zone file as this agent's source of regions and projects, standalone or in a cluster.

Standalone, the file *is* the zone: read and applied before the DNS sockets open (a bad file at
start is fatal, there is no old zone to keep), then followed. In a cluster the file is an import
by the control role: validated at start (a bad one is still fatal) but applied only after the
first sync with a peer, so that only what differs from the cluster's state is written and
restarting the importing agent with an unchanged file changes nothing anywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from region_agent.zonefile.watcher import ZoneFileError, ZoneFileWatcher, off_loop, read_zone_file


class ZoneFileSource:
    def __init__(self, watcher: ZoneFileWatcher, *, synced: Callable[[], Awaitable[None]] | None) -> None:
        """``synced``: in a cluster, waits for the first exchange with a peer (or its timeout); None standalone."""
        self.watcher = watcher
        self._synced = synced
        self.imported = asyncio.Event()   # the first import was tried (cluster mode)

    async def prepare(self) -> None:
        """At start: apply the file (standalone) or validate it (cluster); raises :class:`ZoneFileError`."""
        if self._synced is None:
            await self.watcher.load()
        else:
            await off_loop(read_zone_file, self.watcher.path, self.watcher.max_bytes)

    async def run(self) -> None:
        if self._synced is not None and not self.imported.is_set():
            await self._synced()
            try:
                await self.watcher.load()
            except ZoneFileError as exc:  # changed since start-up and now bad: the watcher reports it
                self.watcher.problem = str(exc)
            self.imported.set()
        await self.watcher.run()
