"""A fake GeoIP download server (aiohttp on 127.0.0.1): databases by name, and the ways a download fails.

``/{name}`` serves ``files[name]`` (404 when absent); ``/signed/{name}`` does the same behind a
presigned URL's signature (403 without :data:`SECRET`); ``/redirect`` sends the client on to a
signed URL of a missing file; ``/stall`` sends 100 of 1500 promised bytes and then nothing until
``release`` is set. ``hits`` counts the requests by path.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.test_utils import TestServer

SECRET = "SECRETsig0123456789abcdef"
SIGNED_QUERY = f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIDEXAMPLE%2F20261201&X-Amz-Signature={SECRET}"


class DbServer:
    """An HTTP server on 127.0.0.1 serving databases by name, and the misbehaving cases."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.hits: Counter[str] = Counter()
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/stall", self._stall)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/signed/{name}", self._signed)
        app.router.add_get("/{name}", self._file)
        self.server = TestServer(app, host="127.0.0.1")

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def _file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[name] += 1
        if name not in self.files:
            raise web.HTTPNotFound()
        return web.Response(body=self.files[name])

    async def _signed(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[f"signed/{name}"] += 1
        if request.query.get("X-Amz-Signature") != SECRET:
            raise web.HTTPForbidden()
        if name not in self.files:
            raise web.HTTPNotFound()
        return web.Response(body=self.files[name])

    async def _redirect(self, request: web.Request) -> web.StreamResponse:
        self.hits["redirect"] += 1
        raise web.HTTPFound(f"/signed/missing.mmdb?{SIGNED_QUERY}")

    async def _stall(self, request: web.Request) -> web.StreamResponse:
        self.hits["stall"] += 1
        response = web.StreamResponse()
        response.content_length = 1500
        await response.prepare(request)
        await response.write(b"\0" * 100)
        await self.release.wait()  # never finishes while the test runs
        return response


@asynccontextmanager
async def serving() -> AsyncIterator[DbServer]:
    """A started :class:`DbServer`; on the way out a stalled download is let go and the server closed."""
    served = DbServer()
    await served.server.start_server()
    try:
        yield served
    finally:
        served.release.set()
        await served.server.close()
