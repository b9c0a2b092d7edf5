"""The two HTTP calls an informer makes, through kubernetes_asyncio's ``ApiClient``.

``ApiClient.call_api`` still does what we want from the client library: the base URL, TLS,
bearer-token auth and its in-cluster token refresh hook. Everything above the transport is ours:
``_preload_content=False`` hands back the raw aiohttp response, so the body is never
deserialised into generated models, watch streams are split into lines by our own reader
(no 2 MiB line limit, no ``watch.Watch``), and every request carries an explicit
``aiohttp.ClientTimeout`` because kubernetes_asyncio >= 32 has none by default (PLATFORM.md §2.4).

Non-2xx answers become :class:`~region_agent.kube.errors.ApiStatusError` (``ResourceExpiredError`` for
410/too-large), because the REST layer does not check the status of unpreloaded responses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from region_agent.kube.errors import ApiStatusError, MalformedObjectError, StreamError

QueryParams = Sequence[tuple[str, str]]


class KubeRequests:
    """GET a JSON document or open a JSON-lines stream on the apiserver."""

    def __init__(self, api: Any, *, connect_timeout: float) -> None:
        # ``api`` is a kubernetes_asyncio ApiClient (untyped library).
        self._api = api
        self._connect_timeout = connect_timeout

    async def get_json(self, path: str, params: QueryParams, *, timeout: float) -> dict[str, Any]:
        """GET ``path`` and return the JSON object body; the whole call is bounded by ``timeout``."""
        client_timeout = aiohttp.ClientTimeout(
            total=timeout, sock_connect=min(self._connect_timeout, timeout), sock_read=timeout
        )
        async with asyncio.timeout(timeout):
            response = await self._call(path, params, client_timeout)
            try:
                body = await response.read()
                if not 200 <= response.status < 300:
                    raise _status_error(response.status, body)
            finally:
                response.release()
        try:
            document = json.loads(body)
        except ValueError as error:
            raise MalformedObjectError(f"GET {path}: body is not JSON: {error}") from error
        if not isinstance(document, dict):
            raise MalformedObjectError(f"GET {path}: body is not a JSON object")
        return document

    @asynccontextmanager
    async def stream_lines(
        self, path: str, params: QueryParams, *, read_timeout: float, max_line_bytes: int
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Open a streaming GET and yield an iterator over its non-empty lines.

        ``read_timeout`` bounds each socket read (a half-open connection raises
        ``TimeoutError``); the caller bounds the stream's total life.
        """
        client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout, sock_read=read_timeout)
        async with asyncio.timeout(self._connect_timeout + read_timeout):
            response = await self._call(path, params, client_timeout)
        try:
            if not 200 <= response.status < 300:
                async with asyncio.timeout(read_timeout):
                    body = await response.read()
                raise _status_error(response.status, body)
            yield _iter_lines(response.content, max_line_bytes)
        finally:
            response.close()  # never reuse a connection of an abandoned stream

    async def _call(self, path: str, params: QueryParams, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        response: aiohttp.ClientResponse = await self._api.call_api(
            path,
            "GET",
            query_params=list(params),
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )
        return response


async def _iter_lines(content: aiohttp.StreamReader, max_line_bytes: int) -> AsyncIterator[bytes]:
    buffer = bytearray()
    while True:
        try:
            chunk = await content.readany()
        except aiohttp.ClientPayloadError as error:  # connection dropped mid-stream
            raise StreamError(f"watch stream broken: {error}") from error
        if not chunk:
            break
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = bytes(buffer[start:end]).strip()
            start = end + 1
            if line:
                yield line
        del buffer[:start]
        if len(buffer) > max_line_bytes:
            raise StreamError(f"watch event longer than {max_line_bytes} bytes")
    tail = bytes(buffer).strip()
    if tail:
        yield tail


def _status_error(http_status: int, body: bytes) -> ApiStatusError:
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if isinstance(status, dict):
        return ApiStatusError.from_status(status, http_status=http_status)
    text = body[:200].decode("utf-8", "replace")
    return ApiStatusError.from_status({"code": http_status, "message": text}, http_status=http_status)
