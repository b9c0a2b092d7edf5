"""A fake CloudNativePG instance manager: ``/pg/status`` and the exporter's ``/metrics`` on loopback.

The status and the lag are plain attributes the test changes; ``fail_with`` makes ``/pg/status``
answer that HTTP status instead.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

STREAMING_REPLICA: dict[str, Any] = {
    "receivedLsn": "0/5000148",
    "replayLsn": "0/5000100",
    "systemID": "7290419",
    "isPrimary": False,
    "replayPaused": False,
    "pendingRestart": False,
    "isWalReceiverActive": True,
    "timeLineID": 1,
    "isReady": True,
}


class FakeCnpgInstance:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.status: dict[str, Any] = dict(STREAMING_REPLICA)
        self.lag: float | None = 1.5
        self.fail_with: int | None = None
        self.status_port = 0
        self.metrics_port = 0
        self.status_requests = 0
        self._runners: list[web.AppRunner] = []

    async def start(self) -> None:
        self.status_port = await self._serve("/pg/status", self._status)
        self.metrics_port = await self._serve("/metrics", self._metrics)

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()

    async def _serve(self, path: str, handler: Any) -> int:
        app = web.Application()
        app.router.add_get(path, handler)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, self.host, 0).start()
        self._runners.append(runner)
        port: int = runner.addresses[0][1]
        return port

    async def _status(self, request: web.Request) -> web.Response:
        self.status_requests += 1
        if self.fail_with is not None:
            return web.Response(status=self.fail_with, text="injected failure")
        return web.json_response(self.status)

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE cnpg_pg_replication_lag gauge"]
        if self.lag is not None:
            lines.append(f"cnpg_pg_replication_lag {self.lag}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
