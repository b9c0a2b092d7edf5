"""A fake Kubernetes API server that speaks the real list/watch wire protocol over HTTP.

Tests point the real kubernetes_asyncio ``ApiClient`` at :attr:`FakeKubeApi.url` and drive the
informer exactly as it would talk to an apiserver: LIST with ``resourceVersion`` /
``resourceVersionMatch`` / ``limit`` / ``continue``, WATCH as a chunked JSON-lines stream of
ADDED / MODIFIED / DELETED / BOOKMARK / ERROR events from a resourceVersion, label and field
selectors (``spec.nodeName`` for pods), and ``timeoutSeconds``.

Everything that goes wrong in real clusters is one method call::

    fake = FakeKubeApi()
    url = await fake.start()
    fake.put(KNATIVE_SERVICES, service_dict)     # ADDED or MODIFIED, resourceVersion assigned
    fake.delete(KNATIVE_SERVICES, "ns", "name")  # DELETED
    fake.bookmark()                              # BOOKMARK to every open watch
    fake.expire_history()                        # watches from older resourceVersions get 410
    fake.send_error(410)                         # an ERROR event into every open watch
    fake.send_raw(b"not json")                   # a raw line into every open watch
    fake.end_watches_at_once()                   # watches end right after the headers
    fake.drop_watches()                          # cut every open watch connection
    fake.refuse_watches(503)                     # new watches answer 503 (None: accept again)
    fake.stall_watches()                         # watches send headers, then nothing (half-open)
    fake.fail_lists(410, times=1)                # the next LIST(s) answer 410
    fake.expire_next_continue()                  # the next LIST page with a continue token is 410
    fake.requests                                # every request: (path, query dict)
    await fake.close()

Resources are addressed by ``region_agent.kube.resources.ResourceRef`` (or its ``label`` string such
as ``"pods"``, ``"services.serving.knative.dev"``). Resource versions are decimal strings here;
the server may compare them, clients must not.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import itertools
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from region_agent.kube.resources import CNPG_CLUSTERS, KNATIVE_SERVICES, PODS, ResourceRef

Obj = dict[str, Any]

KNOWN_KINDS: dict[str, tuple[ResourceRef, str]] = {
    PODS.label: (PODS, "Pod"),
    KNATIVE_SERVICES.label: (KNATIVE_SERVICES, "Service"),
    CNPG_CLUSTERS.label: (CNPG_CLUSTERS, "Cluster"),
}

_PATH = re.compile(
    r"^/(?:api/(?P<core_version>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<namespace>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$"
)


# -- selectors ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()

    def matches(self, present: bool, value: str | None) -> bool:
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # "!=", "notin"


def write_kubeconfig(path: Path, server: str, token: str = "test-token") -> Path:
    """A kubeconfig for the real client library: one cluster at ``server``, a bearer ``token``."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{server}"}}}}]
users: [{{name: agent, user: {{token: {token}}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: agent}}}}]
current-context: fake
""")
    return path


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_selector(text: str | None) -> list[_Requirement]:
    """Selector grammar: ``k``, ``!k``, ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a)``."""
    if not text:
        return []
    requirements = []
    for part in _split_top_level(text):
        if match := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", part):
            values = tuple(v.strip() for v in match.group(3).split(",") if v.strip())
            requirements.append(_Requirement(match.group(1), match.group(2), values))
        elif "!=" in part:
            key, value = part.split("!=", 1)
            requirements.append(_Requirement(key.strip(), "!=", (value.strip(),)))
        elif "=" in part:
            key, value = re.split(r"==?", part, maxsplit=1)
            requirements.append(_Requirement(key.strip(), "=", (value.strip(),)))
        elif part.startswith("!"):
            requirements.append(_Requirement(part[1:].strip(), "!exists"))
        else:
            requirements.append(_Requirement(part, "exists"))
    return requirements


def _field_value(obj: Mapping[str, Any], path: str) -> str | None:
    current: Any = obj
    for step in path.split("."):
        if not isinstance(current, Mapping) or step not in current:
            return None
        current = current[step]
    return None if current is None else str(current)


@dataclass(frozen=True)
class _Filter:
    namespace: str | None
    labels: list[_Requirement]
    fields: list[_Requirement]

    def matches(self, obj: Mapping[str, Any]) -> bool:
        metadata = obj.get("metadata", {})
        if self.namespace and metadata.get("namespace") != self.namespace:
            return False
        labels = metadata.get("labels") or {}
        for requirement in self.labels:
            if not requirement.matches(requirement.key in labels, labels.get(requirement.key)):
                return False
        for requirement in self.fields:
            value = _field_value(obj, requirement.key) or ""
            if not requirement.matches(True, value):
                return False
        return True


# -- watches -----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Watch:
    resource: str
    filter: _Filter
    bookmarks: bool
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)


@dataclass
class _HistoryEntry:
    version: int
    resource: str
    type: str
    obj: Obj
    old: Obj | None


@dataclass
class _Snapshot:
    items: list[Obj]
    version: int


class FakeKubeApi:
    """In-memory apiserver for pods and custom objects; see the module docstring."""

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        self.host = host
        self.url = ""
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.watch_expired_as_http_status = False  # 410 on a watch: HTTP status instead of ERROR event
        self._version = 1000
        self._objects: dict[str, dict[str, Obj]] = {label: {} for label in KNOWN_KINDS}
        self._history: list[_HistoryEntry] = []
        self._history_floor = self._version
        self._watches: set[_Watch] = set()
        self._stalled = False
        self._end_at_once = False
        self._refuse_watch_status: int | None = None
        self._list_failures: list[tuple[int, str | None]] = []
        self._expire_next_continue = False
        self._snapshots: dict[str, _Snapshot] = {}
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._tokens = itertools.count(1)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port)
        await site.start()
        actual_port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{actual_port}"
        return self.url

    async def close(self) -> None:
        self._closing.set()
        for watch in list(self._watches):
            watch.queue.put_nowait(("close", None))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- state changes -----------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        return str(self._version)

    def objects(self, resource: ResourceRef | str) -> dict[str, Obj]:
        """Stored objects of a resource, ``namespace/name`` → object (a deep copy)."""
        return copy.deepcopy(self._objects[_label(resource)])

    def put(self, resource: ResourceRef | str, obj: Mapping[str, Any]) -> Obj:
        """Create or replace an object; returns it as stored (resourceVersion, uid, ... filled in)."""
        label = _label(resource)
        stored = copy.deepcopy(dict(obj))
        metadata = stored.setdefault("metadata", {})
        ref, kind = KNOWN_KINDS[label]
        stored.setdefault("apiVersion", f"{ref.group}/{ref.version}" if ref.group else ref.version)
        stored.setdefault("kind", kind)
        metadata.setdefault("namespace", "default")
        key = f"{metadata['namespace']}/{metadata['name']}"
        old = self._objects[label].get(key)
        metadata.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
        metadata.setdefault(
            "creationTimestamp", old["metadata"]["creationTimestamp"] if old else "2026-01-01T00:00:00Z"
        )
        if "generation" not in metadata:
            generation = old["metadata"].get("generation", 1) if old else 1
            if old is not None and old.get("spec") != stored.get("spec"):
                generation += 1
            metadata["generation"] = generation
        self._version += 1
        metadata["resourceVersion"] = str(self._version)
        self._objects[label][key] = stored
        self._record(label, "MODIFIED" if old else "ADDED", stored, old)
        return copy.deepcopy(stored)

    def put_many(self, resource: ResourceRef | str, objs: Iterable[Mapping[str, Any]]) -> None:
        for obj in objs:
            self.put(resource, obj)

    def delete(self, resource: ResourceRef | str, namespace: str, name: str) -> None:
        label = _label(resource)
        old = self._objects[label].pop(f"{namespace}/{name}")
        self._version += 1
        final = copy.deepcopy(old)
        final["metadata"]["resourceVersion"] = str(self._version)
        self._record(label, "DELETED", final, old)

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current resourceVersion to every open watch that allows them."""
        for watch in self._watches:
            if watch.bookmarks:
                watch.queue.put_nowait(("bookmark", None))

    def expire_history(self) -> None:
        """Forget the event history: a watch from any resourceVersion before now gets 410."""
        self._history.clear()
        self._history_floor = self._version

    def send_error(self, code: int = 410, reason: str = "Expired") -> None:
        """Send an ERROR event (a Status with ``code``) into every open watch, then end it."""
        for watch in self._watches:
            watch.queue.put_nowait(("error", (code, reason)))

    def drop_watches(self) -> None:
        """Abort every open watch connection (TCP close without the final chunk)."""
        for watch in self._watches:
            watch.queue.put_nowait(("drop", None))

    def send_raw(self, line: bytes) -> None:
        """Write ``line`` (plus a newline) into every open watch as it is: for malformed-input tests."""
        for watch in self._watches:
            watch.queue.put_nowait(("raw", line))

    def end_watches_at_once(self, enabled: bool = True) -> None:
        """New watches end cleanly right after the headers, without a single event."""
        self._end_at_once = enabled

    def refuse_watches(self, status: int | None = 503) -> None:
        """New watches answer ``status`` until called with None."""
        self._refuse_watch_status = status

    def stall_watches(self, stalled: bool = True) -> None:
        """Open watches go silent, new ones send headers and then nothing: a half-open connection."""
        self._stalled = stalled
        if stalled:
            for watch in self._watches:
                watch.queue.put_nowait(("stall", None))

    def fail_lists(self, status: int, *, times: int = 1, resource: ResourceRef | str | None = None) -> None:
        """The next ``times`` LIST requests (first pages, of ``resource`` or any) answer ``status``."""
        label = None if resource is None else _label(resource)
        self._list_failures.extend([(status, label)] * times)

    def expire_next_continue(self) -> None:
        """The next LIST page requested with a continue token answers 410 Expired."""
        self._expire_next_continue = True

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def list_requests(self, resource: ResourceRef | str) -> list[dict[str, str]]:
        path_suffix = f"/{_ref(resource).plural}"
        return [q for p, q in self.requests if p.endswith(path_suffix) and q.get("watch") not in ("true", "1")]

    def watch_requests(self, resource: ResourceRef | str) -> list[dict[str, str]]:
        path_suffix = f"/{_ref(resource).plural}"
        return [q for p, q in self.requests if p.endswith(path_suffix) and q.get("watch") in ("true", "1")]

    def _record(self, label: str, event_type: str, obj: Obj, old: Obj | None) -> None:
        entry = _HistoryEntry(self._version, label, event_type, copy.deepcopy(obj), old)
        self._history.append(entry)
        for watch in self._watches:
            if watch.resource == label:
                watch.queue.put_nowait(("event", entry))

    # -- HTTP --------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((request.path, query))
        match = _PATH.match(request.path)
        if not match:
            return _status(404, "NotFound", f"no route {request.path}")
        group = match.group("group") or ""
        version = match.group("core_version") or match.group("version")
        label = f"{match.group('plural')}.{group}" if group else match.group("plural")
        if label not in KNOWN_KINDS or KNOWN_KINDS[label][0].version != version:
            return _status(404, "NotFound", f"the server could not find the requested resource ({label})")
        namespace = match.group("namespace")
        if match.group("name"):
            return self._get_one(label, namespace or "", match.group("name"))
        try:
            filter_ = _Filter(
                namespace,
                parse_selector(query.get("labelSelector")),
                parse_selector(query.get("fieldSelector")),
            )
        except ValueError as error:
            return _status(400, "BadRequest", str(error))
        if query.get("watch") in ("true", "1"):
            return await self._watch(request, label, filter_, query)
        return self._list(label, filter_, query)

    def _get_one(self, label: str, namespace: str, name: str) -> web.Response:
        obj = self._objects[label].get(f"{namespace}/{name}")
        if obj is None:
            return _status(404, "NotFound", f'{label} "{name}" not found')
        return web.json_response(obj)

    def _list(self, label: str, filter_: _Filter, query: Mapping[str, str]) -> web.Response:
        version = query.get("resourceVersion")
        match = query.get("resourceVersionMatch")
        token = query.get("continue")
        if match and not version:
            return _status(400, "BadRequest", "resourceVersionMatch is forbidden unless resourceVersion is set")
        if match and token:
            return _status(400, "BadRequest", "resourceVersionMatch is forbidden when continue is set")
        if match == "Exact" and version == "0":
            return _status(400, "BadRequest", "resourceVersionMatch=Exact is forbidden for resourceVersion 0")
        try:
            limit = int(query.get("limit", "0") or 0)
        except ValueError:
            return _status(400, "BadRequest", "limit must be an integer")

        if token:
            if self._expire_next_continue:
                self._expire_next_continue = False
                return _status(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a "
                    "consistent list result. You can start a new list without the continue parameter.",
                )
            try:
                snapshot_id, offset = json.loads(base64.urlsafe_b64decode(token.encode()))
                snapshot = self._snapshots[snapshot_id]
            except (ValueError, KeyError, TypeError):
                return _status(400, "BadRequest", "invalid continue token")
        else:
            failure = next((f for f in self._list_failures if f[1] in (None, label)), None)
            if failure is not None:
                self._list_failures.remove(failure)
                status = failure[0]
                reason = "Expired" if status == 410 else "InternalError"
                return _status(status, reason, f"injected failure {status}")
            if version and version != "0":
                if not version.isdigit():
                    return _status(400, "BadRequest", f"invalid resourceVersion {version!r}")
                if int(version) > self._version:
                    return _status(504, "Timeout", "Too large resource version", causes=["ResourceVersionTooLarge"])
                if match == "Exact" and int(version) != self._version:
                    return _status(410, "Expired", f"too old resource version: {version} ({self._version})")
            items = [obj for key, obj in sorted(self._objects[label].items()) if filter_.matches(obj)]
            snapshot_id = f"s{next(self._tokens)}"
            snapshot = _Snapshot(items, self._version)
            self._snapshots[snapshot_id] = snapshot
            offset = 0
        end = len(snapshot.items) if limit <= 0 else offset + limit
        page = snapshot.items[offset:end]
        metadata: dict[str, Any] = {"resourceVersion": str(snapshot.version)}
        if end < len(snapshot.items):
            metadata["continue"] = base64.urlsafe_b64encode(json.dumps([snapshot_id, end]).encode()).decode()
            metadata["remainingItemCount"] = len(snapshot.items) - end
        ref, kind = KNOWN_KINDS[label]
        body = {
            "kind": f"{kind}List",
            "apiVersion": f"{ref.group}/{ref.version}" if ref.group else "v1",
            "metadata": metadata,
            "items": page,
        }
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    async def _watch(
        self, request: web.Request, label: str, filter_: _Filter, query: Mapping[str, str]
    ) -> web.StreamResponse:
        if self._refuse_watch_status is not None:
            return _status(self._refuse_watch_status, "ServiceUnavailable", "watches refused by the test")
        version = query.get("resourceVersion", "")
        if version not in ("", "0") and not version.isdigit():
            return _status(400, "BadRequest", f"invalid resourceVersion {version!r}")
        expired = version not in ("", "0") and int(version) < self._history_floor
        if expired and self.watch_expired_as_http_status:
            return _status(410, "Expired", f"too old resource version: {version} ({self._history_floor})")
        timeout = float(query.get("timeoutSeconds") or 1800)
        watch = _Watch(label, filter_, query.get("allowWatchBookmarks") in ("true", "1"))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if self._stalled:
            await self._closing.wait()
            return response
        if self._end_at_once:
            await response.write_eof()
            return response
        if expired:
            await _write(
                response,
                _error_event(410, "Expired", f"too old resource version: {version} ({self._history_floor})"),
            )
            await response.write_eof()
            return response

        # Backlog: synthetic ADDED for an unanchored watch, history after the version otherwise.
        if version in ("", "0"):
            for _key, obj in sorted(self._objects[label].items()):
                if filter_.matches(obj):
                    await _write(response, {"type": "ADDED", "object": obj})
        else:
            for entry in self._history:
                if entry.resource == label and entry.version > int(version):
                    event = _filtered_event(entry, filter_)
                    if event is not None:
                        await _write(response, event)

        self._watches.add(watch)
        try:
            return await self._stream(request, response, watch, timeout)
        finally:
            self._watches.discard(watch)

    async def _stream(
        self, request: web.Request, response: web.StreamResponse, watch: _Watch, timeout: float
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                if watch.bookmarks:  # like the watch cache: one bookmark right before the deadline
                    await _write(response, _bookmark(self._bookmark_kind(watch), self._version))
                await response.write_eof()
                return response
            try:
                async with asyncio.timeout(remaining):
                    command, payload = await watch.queue.get()
            except TimeoutError:
                continue
            if command == "event":
                event = _filtered_event(payload, watch.filter)
                if event is not None:
                    await _write(response, event)
            elif command == "raw":
                await response.write(payload + b"\n")
            elif command == "bookmark":
                await _write(response, _bookmark(self._bookmark_kind(watch), self._version))
            elif command == "error":
                code, reason = payload
                await _write(response, _error_event(code, reason, f"injected error {code}"))
                await response.write_eof()
                return response
            elif command == "drop":
                transport = request.transport
                if transport is not None:
                    transport.abort()
                return response
            elif command == "stall":
                await self._closing.wait()
                return response
            else:  # close
                return response

    def _bookmark_kind(self, watch: _Watch) -> tuple[str, str]:
        ref, kind = KNOWN_KINDS[watch.resource]
        return (f"{ref.group}/{ref.version}" if ref.group else "v1", kind)


def _filtered_event(entry: _HistoryEntry, filter_: _Filter) -> dict[str, Any] | None:
    """The event a selector-filtered watcher sees (objects leaving the selector are DELETED)."""
    now_matches = filter_.matches(entry.obj)
    before_matched = entry.old is not None and filter_.matches(entry.old)
    if entry.type == "DELETED":
        return {"type": "DELETED", "object": entry.obj} if before_matched else None
    if now_matches and before_matched:
        return {"type": "MODIFIED", "object": entry.obj}
    if now_matches:
        return {"type": "ADDED", "object": entry.obj}
    if before_matched:
        return {"type": "DELETED", "object": entry.obj}
    return None


def _bookmark(api_kind: tuple[str, str], version: int) -> dict[str, Any]:
    api_version, kind = api_kind
    return {
        "type": "BOOKMARK",
        "object": {"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": str(version)}},
    }


def _error_event(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        },
    }


async def _write(response: web.StreamResponse, event: Mapping[str, Any]) -> None:
    await response.write(json.dumps(event).encode() + b"\n")


def _status(code: int, reason: str, message: str, *, causes: list[str] | None = None) -> web.Response:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if causes:
        body["details"] = {"causes": [{"reason": c} for c in causes]}
    return web.json_response(body, status=code)


def _label(resource: ResourceRef | str) -> str:
    label = resource.label if isinstance(resource, ResourceRef) else resource
    if label not in KNOWN_KINDS:
        raise KeyError(f"unknown resource {label!r}; known: {sorted(KNOWN_KINDS)}")
    return label


def _ref(resource: ResourceRef | str) -> ResourceRef:
    return KNOWN_KINDS[_label(resource)][0]
