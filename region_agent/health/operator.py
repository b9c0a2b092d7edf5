"""What only the operator listener has: renders that cost once, not per request.

- :class:`MetricsCache`: ``generate_latest`` at most once per ``metrics_cache_seconds``
  whoever asks (N scrapers cost one render), rendered in a worker thread so the event loop
  (which also answers DNS in the agent) keeps running between the thread's GIL slices.
- :class:`Document` and :class:`DocumentCache`: a JSON document (the agent's ``/zone``)
  serialized once per *generation* (a key the provider computes cheaply, e.g. the zone tables'
  identity, a count of state changes and readiness) and served as bytes until the key changes.
  The items of its top-level lists are encoded one by one and kept by identity, so a new
  generation re-encodes only the records that are new objects: at 2,000 projects the whole
  ``/zone`` is ~1 MB and ~100 ms to encode, one recompiled project a fraction of a millisecond.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

__all__ = ["Document", "DocumentCache", "MetricsCache"]

logger = logging.getLogger("region_agent.health")


class MetricsCache:
    """The registry's exposition text, rendered at most once per ``max_age`` seconds."""

    def __init__(self, registry: CollectorRegistry, *, max_age: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._max_age = max_age
        self._monotonic = monotonic
        self._body = b""
        self._rendered_at: float | None = None
        self._pending: asyncio.Future[bytes] | None = None
        self.renders = 0

    async def get(self) -> bytes:
        rendered_at = self._rendered_at
        if rendered_at is not None and self._monotonic() - rendered_at < self._max_age:
            return self._body
        if self._pending is None:  # one render in flight; every other scraper waits for it
            self._pending = asyncio.ensure_future(self._render())
        return await asyncio.shield(self._pending)

    async def _render(self) -> bytes:
        try:
            try:
                body = await asyncio.to_thread(generate_latest, self._registry)
            except RuntimeError:
                # A collector iterated a dict the loop changed meanwhile: render here, where
                # nothing else runs, rather than serve an error.
                body = generate_latest(self._registry)
            self.renders += 1
            self._body = body
            self._rendered_at = self._monotonic()
            return body
        finally:
            self._pending = None


@dataclass(frozen=True, slots=True)
class Document:
    """A read-only JSON document of the operator listener.

    ``generation`` must be cheap and change whenever ``render`` would return something else.
    Items of the top-level lists ``render`` returns must not be mutated afterwards (a changed
    record is a new object): their encoding is reused while the same object comes back.
    """

    render: Callable[[], object]
    generation: Callable[[], Hashable]


class DocumentCache:
    """Serialized bytes of one :class:`Document`, kept until its generation changes.

    ``render`` runs on the loop (it should only collect references); the encoding runs in a
    worker thread, one at a time, item by item, so that even a full re-encode (the first
    request, every project recompiled) leaves the loop a turn every GIL switch interval
    instead of holding it for the ~100 ms a 1 MB document takes.
    """

    __slots__ = ("_body", "_document", "_generation", "_items", "_pending", "renders")

    def __init__(self, document: Document) -> None:
        self._document = document
        self._generation: Hashable = object()  # equal to nothing: the first get renders
        self._body = b""
        # id(item) -> (item, its JSON). Holding the item keeps its id from being reused.
        self._items: dict[int, tuple[object, bytes]] = {}
        self._pending: asyncio.Future[None] | None = None
        self.renders = 0

    async def get(self) -> bytes:
        # Twice at most: a document that changes faster than it encodes is served one behind.
        for _ in range(2):
            generation = self._document.generation()
            if generation == self._generation:
                break
            if self._pending is None:
                self._pending = asyncio.ensure_future(self._render(generation))
            await asyncio.shield(self._pending)
        return self._body

    async def _render(self, generation: Hashable) -> None:
        try:
            data = self._document.render()
            self._body = await asyncio.to_thread(self._encode, data)
            self._generation = generation
            self.renders += 1
        finally:
            self._pending = None

    def _encode(self, data: object) -> bytes:
        """``json.dumps(data, default=str, separators=(",", ":"))``, reusing the encoding of known items."""
        if not isinstance(data, Mapping):
            return _dumps(data)
        known, kept = self._items, {}
        fields = []
        for key, value in data.items():
            if isinstance(value, list):
                encoded = []
                for item in value:
                    hit = known.get(id(item)) or (item, _dumps(item))
                    kept[id(item)] = hit
                    encoded.append(hit[1])
                body = b"[" + b",".join(encoded) + b"]"
            else:
                body = _dumps(value)
            fields.append(_dumps(str(key)) + b":" + body)
        self._items = kept
        return b"{" + b",".join(fields) + b"}"


def _dumps(value: object) -> bytes:
    return json.dumps(value, default=str, separators=(",", ":")).encode()
