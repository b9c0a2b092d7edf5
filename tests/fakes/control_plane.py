"""A fake control-plane usage endpoint (aiohttp on loopback) that can misbehave on purpose.

It implements the contract in ``region_agent/usage/README.md`` independently of the agent's code: it
checks the bearer token and the batch shape, recomputes every record's idempotency key from its
fields, stores each key once, and answers 200 only after storing. What tests read afterwards:
``records`` (key → record, first copy), ``conflicts`` (a key seen again with other content —
must stay empty), ``duplicates`` (records received again: retries, harmless by design).

Faults are scripted per request (``script``, consumed in order) or persistent (``mode``):

================  ===============================================================================
``ok``            store, 200
``fail-500``      store nothing, 500
``fail-503``      store nothing, 503 with ``Retry-After: <retry_after>``
``throttle``      store nothing, 429 with ``Retry-After: <retry_after>``
``stall``         wait ``stall_for`` s (longer than the client's timeout), then store and answer
                  200 to nobody: the agent gave up and will resend what was committed
``hang``          wait until :meth:`release` (a request in flight forever; crash tests)
``store-drop``    store, then drop the connection without an answer
``drop``          drop the connection without storing
``store-500``     store, then answer 500 (committed but reported as failed)
``ack-twice``     apply the batch twice, as if a proxy delivered it twice, then 200
``reject``        400 (a verdict on the batch: the agent quarantines / bisects)
``unauthorized``  401
``too-large``     413
================  ===============================================================================

``poison`` keys are rejected with 400 whenever a batch contains one, to test bisection.
:meth:`FakeControlPlane.outage` stops listening (connections refused) while keeping the port, and
:meth:`FakeControlPlane.recover` listens again on it.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

FAULTS = ("ok", "fail-500", "fail-503", "throttle", "stall", "hang", "store-drop", "drop", "store-500",
          "ack-twice", "reject", "unauthorized", "too-large")

RECORD_FIELDS = {
    "key": str, "region": str, "node": str, "slug": str, "namespace": str, "service": str, "revision": str,
    "pod": str, "pod_uid": str, "session_start": int, "start": int, "end": int, "seconds": int, "final": bool,
    "size": dict, "always_on": bool, "min_scale": int,
}


def expected_key(region: str, pod_uid: str, start: int) -> str:
    """The documented key derivation (README: "Idempotency key")."""
    return hashlib.sha256(f"usage/v1\n{region}\n{pod_uid}\n{start}".encode()).hexdigest()


@dataclass
class FakeControlPlane:
    token: str = "test-token"
    host: str = "127.0.0.1"
    port: int = 0
    mode: str = "ok"
    retry_after: str = "1"
    stall_for: float = 1.0
    script: deque[str] = field(default_factory=deque)
    poison: set[str] = field(default_factory=set)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    conflicts: list[tuple[str, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    duplicates: int = 0
    requests: int = 0
    faults_served: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0

    def __post_init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self._server: asyncio.base_events.Server | None = None
        self._placeholder: socket.socket | None = None
        self._release = asyncio.Event()
        self._handlers: set[asyncio.Task[Any]] = set()

    # Lifecycle. outage()/recover() keep the port, so an outage is a real "connection refused" and no
    # other process on the machine can take the port meanwhile.

    async def outage(self) -> None:
        """Stop listening: connections are refused until :meth:`recover`. The port stays reserved."""
        assert self._server is not None
        self._server.close()  # the listening socket closes now, synchronously...
        placeholder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        placeholder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        placeholder.bind((self.host, self.port))  # ...and the port is held at once (bound, not listening)
        self._placeholder = placeholder
        await self.stop()

    async def recover(self) -> None:
        """Listen again on the same port (bound beside the placeholder, which is then released)."""
        await self.start()
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/usage", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self._server = server
        if self.port == 0:
            self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._release.set()
        self._server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._release = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1/usage"

    def close_placeholder(self) -> None:
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None

    def release(self) -> None:
        """Let ``hang`` requests finish (they then store nothing and answer 503)."""
        self._release.set()

    # What tests assert on.

    @property
    def total_seconds(self) -> int:
        return sum(int(r["seconds"]) for r in self.records.values())

    def intervals(self) -> dict[str, list[tuple[int, int]]]:
        """Pod uid → its billed intervals, sorted."""
        out: dict[str, list[tuple[int, int]]] = {}
        for r in self.records.values():
            out.setdefault(r["pod_uid"], []).append((r["start"], r["end"]))
        return {uid: sorted(v) for uid, v in out.items()}

    def seconds_by_pod(self) -> dict[str, int]:
        return {uid: sum(e - s for s, e in v) for uid, v in self.intervals().items()}

    def overlaps(self) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
        bad = []
        for uid, spans in self.intervals().items():
            for a, b in itertools.pairwise(spans):
                if b[0] < a[1]:
                    bad.append((uid, a, b))
        return bad

    # The endpoint.

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        fault = self.script.popleft() if self.script else self.mode
        self.faults_served[fault] = self.faults_served.get(fault, 0) + 1
        self.in_flight += 1
        try:
            return await self._serve(request, fault)
        finally:
            self.in_flight -= 1

    async def _serve(self, request: web.Request, fault: str) -> web.StreamResponse:
        if fault == "unauthorized" or request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": "bad token"}, status=401)
        try:
            batch = json.loads(await request.read())
        except ValueError:
            self.malformed.append("body is not JSON")
            return web.json_response({"error": "body is not JSON"}, status=400)
        problem = self._check(batch)
        if problem:
            self.malformed.append(problem)
            return web.json_response({"error": problem}, status=400)
        records: list[dict[str, Any]] = batch["records"]
        if any(r["key"] in self.poison for r in records):
            return web.json_response({"error": "poison record"}, status=400)
        if fault == "fail-500":
            return web.json_response({"error": "boom"}, status=500)
        if fault == "fail-503":
            return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": self.retry_after})
        if fault == "throttle":
            return web.json_response({"error": "slow down"}, status=429, headers={"Retry-After": self.retry_after})
        if fault == "reject":
            return web.json_response({"error": "no"}, status=400)
        if fault == "too-large":
            return web.json_response({"error": "too large"}, status=413)
        if fault == "drop":
            return self._drop(request)
        if fault == "hang":
            await self._release.wait()
            return web.json_response({"error": "released"}, status=503)
        if fault == "stall":
            await asyncio.sleep(self.stall_for)
        accepted = self._store(records)
        if fault == "ack-twice":
            accepted += self._store(records)
        if fault == "store-drop":
            return self._drop(request)
        if fault == "store-500":
            return web.json_response({"error": "committed, then failed"}, status=500)
        return web.json_response({"accepted": accepted, "duplicates": len(records) - accepted})

    def _check(self, batch: Any) -> str:
        if not isinstance(batch, dict) or batch.get("schema") != 1 or not isinstance(batch.get("records"), list):
            return "batch must be an object with schema 1 and a records list"
        for r in batch["records"]:
            for name, kind in RECORD_FIELDS.items():
                if not isinstance(r.get(name), kind):
                    return f"record field {name} missing or not {kind.__name__}"
            if r["key"] != expected_key(r["region"], r["pod_uid"], r["start"]):
                return f"record key {r['key']} does not match its region, pod_uid and start"
            if r["seconds"] != r["end"] - r["start"] or r["seconds"] <= 0:
                return f"record {r['key']}: seconds must be end - start and positive"
        return ""

    def _store(self, records: list[dict[str, Any]]) -> int:
        accepted = 0
        for r in records:
            old = self.records.get(r["key"])
            if old is None:
                self.records[r["key"]] = r
                accepted += 1
            elif old != r:
                self.conflicts.append((r["key"], old, r))
            else:
                self.duplicates += 1
        return accepted

    @staticmethod
    def _drop(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if transport is not None:
            transport.abort()  # RST/close without a status line: the client sees a disconnect
        return web.Response(status=500)  # never reaches the client
