"""The control API (``/v1/...``): the control plane writes projects, regions and fences through any agent.

:class:`ControlAPI` is one request handler, ``handle(request)``, that the operator listener
hands every path under :data:`PREFIX` (its low-level server has no router), and that
:meth:`ControlAPI.install` also adds to an ``aiohttp.web.Application`` route by route.
Its collaborators are injected: the store, this agent's node and region, and callables for
the membership, the write gate (:func:`region_agent.cluster.quorum.has_majority`), the store
digests other agents announced and the zone's description.

Contract (the OpenAPI document ``openapi.json`` beside this module, served at
``/v1/openapi.json``, is the reference; a test keeps it and :data:`ROUTES` equal):

- **auth**: ``Authorization: Bearer <token>`` against the token file (:class:`BearerToken`,
  re-read when the file changes); 401 JSON otherwise. Only ``/v1/openapi.json`` is open.
  Mutual TLS is not offered by the operator listener yet (see README).
- **errors**: 4xx JSON ``{"error": "...", "field": "<json path>"}`` naming the field
  (``$.regions[1]``, ``path.slug``, ``header.Idempotency-Key``) and changing nothing;
  bodies are bounded (``max_body_bytes``, 413) and must be JSON (415), unknown fields are
  refused (422).
- **writes** (PUT, DELETE, POST) go through ``store.put_many(items, writer="control/<region>.<node>")``
  and only while ``has_majority()``: otherwise 503 with ``Retry-After`` and
  ``X-Degraded: true`` (reads keep working), so a partition never swallows a change.
- **idempotency**: ``Idempotency-Key`` (or a well-formed ``X-Request-Id``) replays the first
  successful answer (:mod:`region_agent.control.idempotency`), 409 for the same key with another
  request.
- **versions**: a project's and a region's GET and PUT answers carry an ``ETag`` (the version of
  its entry); a PUT or DELETE with ``If-Match`` (an ETag, or ``*``: it must exist) is refused with
  412 when the resource changed meanwhile, so a read-modify-write through any agent is safe.
  Unconditional concurrent writes are last-writer-wins (on the HLC), as everything in the store.
- every answer carries ``X-Region`` and ``X-Request-Id`` like the health listener's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from region_agent.base.bearer import BearerToken
from region_agent.base.request_ids import RequestIds, is_valid_request_id
from region_agent.base.tracing import request_spans
from region_agent.cluster.members import MemberRow
from region_agent.control.idempotency import IdempotencyCache, KeyConflictError, ReplicatedIdempotency, fingerprint
from region_agent.control.validation import (
    ApiError,
    parse_body,
    parse_fence,
    parse_project,
    parse_region,
    path_region,
    path_slug,
)
from region_agent.state.model import (
    CONTROL,
    Key,
    Project,
    Region,
    Value,
    fence_key,
    project_key,
    region_key,
    role_writer,
    writer_agent,
    writer_role,
)
from region_agent.state.serial import zone_serial
from region_agent.state.store import Store, Version

__all__ = ["DEFAULT_MAX_BODY_BYTES", "FALLBACK", "PREFIX", "ROUTES", "ControlAPI", "Route", "load_openapi"]

PREFIX = "/v1/"
FALLBACK = "/v1/{rest:.*}"  # install(): the catch-all after the routes
DEFAULT_MAX_BODY_BYTES = 64 * 1024
DEFAULT_RETRY_AFTER_SECONDS = 5
_KEY_PATTERN = re.compile(r"[\x21-\x7e]{1,255}")  # visible ASCII, like a header token
_ORG_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")  # X-Org-Id: traced only when it looks like an id
_JSON = "application/json"


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    template: str  # aiohttp / OpenAPI style: /v1/projects/{slug}
    handler: str  # the ControlAPI handler answering it (its table is checked when the API is built)
    write: bool = False

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(self.template)) + "$")


ROUTES: tuple[Route, ...] = (
    Route("GET", "/v1/openapi.json", "openapi"),
    Route("GET", "/v1/projects", "list_projects"),
    Route("GET", "/v1/projects/{slug}", "get_project"),
    Route("PUT", "/v1/projects/{slug}", "put_project", write=True),
    Route("DELETE", "/v1/projects/{slug}", "delete_project", write=True),
    Route("GET", "/v1/regions", "list_regions"),
    Route("GET", "/v1/regions/{name}", "get_region"),
    Route("PUT", "/v1/regions/{name}", "put_region", write=True),
    Route("DELETE", "/v1/regions/{name}", "delete_region", write=True),
    Route("POST", "/v1/regions/{name}/fence", "fence", write=True),
    Route("POST", "/v1/regions/{name}/unfence", "unfence", write=True),
    Route("GET", "/v1/zone", "zone"),
    Route("GET", "/v1/members", "members"),
    Route("GET", "/v1/digests", "digests"),
)
_OPEN = frozenset(("openapi",))  # answered without a token
_COMPILED = tuple((route, route.pattern) for route in ROUTES)


def _template(path: str) -> str | None:
    """The route a path falls under, whatever the method (a span's ``http.route``)."""
    return next((route.template for route, pattern in _COMPILED if pattern.match(path)), None)


_METHODS = frozenset(("GET", "PUT", "POST", "DELETE", "HEAD", "PATCH", "OPTIONS"))


class _RequestsCollector(Collector):
    def __init__(self, requests: Counter[tuple[str, str, str]]) -> None:
        self._requests = requests

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("region_agent_control_requests", "Control-API requests by method, route "
                                     "template (other: no route) and status", labels=["method", "route", "status"])
        for (method, route, status), count in sorted(self._requests.items()):
            family.add_metric([method, route, status], count)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())


def load_openapi() -> dict[str, Any]:
    """The checked-in OpenAPI 3.1 document."""
    text = resources.files("region_agent.control").joinpath("openapi.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


@dataclass(slots=True)
class _Result:
    status: int
    payload: object = None  # JSON-able; None with 204
    headers: dict[str, str] | None = None


def etag(version: Version) -> str:
    """A strong ETag naming one version of an entry (HLC and writer)."""
    return f'"{version.hlc:x}-{hashlib.blake2b(version.writer.encode(), digest_size=4).hexdigest()}"'


def _project_document(project: Project, regions: Mapping[str, Region]) -> dict[str, Any]:
    """A project as read: its fields, and ``problems`` when a region it names is not configured (the zone
    leaves that region out of its answers; a silent NODATA if it was the only one)."""
    document = project.to_dict()
    missing = [r for r in project.regions if r not in regions]
    if missing:
        document["problems"] = [f"region {r} is not configured: left out of the answers" for r in missing]
    return document


def _dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=False).encode()


_H = TypeVar("_H")
_Read = Callable[[dict[str, str]], Awaitable[_Result]]
_Write = Callable[[dict[str, str], dict[str, Any]], _Result]  # synchronous: see _write


def _bind(handlers: Mapping[str, _H], routes: Iterable[Route]) -> dict[Route, _H]:
    """Each route's handler by name; a route without a handler or a handler without a route raises."""
    routes = list(routes)
    names = {route.handler for route in routes}
    if names != handlers.keys():
        raise LookupError(f"control API handlers and ROUTES disagree: no handler for {sorted(names - handlers.keys())}"
                          f", no route for {sorted(handlers.keys() - names)}")
    return {route: handlers[route.handler] for route in routes}


class ControlAPI:
    """The ``/v1`` handler; see the module docstring for the contract."""

    def __init__(
        self,
        *,
        store: Store,
        node: str,
        region: str,
        members: Callable[[], Iterable[MemberRow]],
        has_majority: Callable[[], bool],
        digests: Callable[[], Mapping[str, str | None]],
        token: BearerToken | None,
        zone: Callable[[], Mapping[str, object]] | None = None,
        idempotency: IdempotencyCache | ReplicatedIdempotency | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        retry_after_seconds: int = DEFAULT_RETRY_AFTER_SECONDS,
        wall: Callable[[], float] = time.time,
        allow_unauthenticated: bool = False,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """``token`` None refuses every request with 401 unless ``allow_unauthenticated`` (tests, demos).

        ``digests``: member name → the store digest it last announced (None: not heard yet).
        ``members``: the membership as rows (:func:`region_agent.cluster.members.member_rows`).
        ``zone``: the zone's description (the agent's ``/zone`` document); without it
        ``/v1/zone`` describes the replicated records.
        """
        self.writer = role_writer(store.writer, CONTROL) if writer_agent(store.writer) else f"control/{node}"
        writer_role(self.writer)  # raises for a node name with a slash
        self.store = store
        self.node = node
        self.region = region
        self._members = members
        self._has_majority = has_majority
        self._digests = digests
        self._token = token
        self._zone = zone
        # Kept in the replicated store: a retry replays at any agent, and after a restart.
        self._idempotency = idempotency if idempotency is not None else ReplicatedIdempotency(store, self.writer)
        self._max_body = max_body_bytes
        self._retry_after = retry_after_seconds
        self._allow_unauthenticated = allow_unauthenticated
        self._ids = RequestIds(region, wall=wall)
        # (method, route template, status) → requests: plain ints, a collector exports them at scrape time
        self.requests: Counter[tuple[str, str, str]] = Counter()
        if registry is not None:
            registry.register(_RequestsCollector(self.requests))
        self._spans = request_spans("control")  # None while tracing is off
        self._openapi_body = _dumps(load_openapi())
        self._if_match: str | None = None   # of the write being handled (set and cleared around it)
        reads: dict[str, _Read] = {
            "openapi": self._do_openapi, "list_projects": self._do_list_projects, "get_project": self._do_get_project,
            "list_regions": self._do_list_regions, "get_region": self._do_get_region, "zone": self._do_zone,
            "members": self._do_members, "digests": self._do_digests,
        }
        writes: dict[str, _Write] = {
            "put_project": self._do_put_project, "delete_project": self._do_delete_project,
            "put_region": self._do_put_region, "delete_region": self._do_delete_region,
            "fence": self._do_fence, "unfence": self._do_unfence,
        }
        self._reads = _bind(reads, (route for route in ROUTES if not route.write))
        self._writes = _bind(writes, (route for route in ROUTES if route.write))

    # --- wiring -------------------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        """aiohttp route definitions, one per :data:`ROUTES` entry, all answered by :meth:`handle`."""
        return [web.route(route.method, route.template, self._app_handler) for route in ROUTES]

    def install(self, app: web.Application) -> None:
        """Add :meth:`routes` and a fallback under :data:`PREFIX`, so unknown paths and methods get our 404/405."""
        app.add_routes(self.routes())
        app.router.add_route("*", FALLBACK, self._app_handler)

    async def _app_handler(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request)

    # --- requests -----------------------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.Response:
        """Answer one request under :data:`PREFIX` (a low-level server's handler, or a route's)."""
        spans = self._spans
        if spans is None:
            response = await self._handle(request)
            self._count(request, response.status)
            return response
        started = time.perf_counter()
        status: int | None = None
        request_id: str | None = None
        error: str | None = None
        try:
            response = await self._handle(request)
            status, request_id = response.status, response.headers.get("X-Request-Id")
            self._count(request, status)
            return response
        except BaseException as exc:
            error = type(exc).__name__
            raise
        finally:
            # org_id: the control plane's X-Org-Id, when well formed and the caller was not refused.
            org = request.headers.get("X-Org-Id")
            spans.record(method=request.method, route=_template(request.path), path=request.path, status=status,
                         request_id=request_id, seconds=time.perf_counter() - started, headers=request.headers,
                         org_id=org if org and status != 401 and _ORG_PATTERN.fullmatch(org) else None,
                         error=error)

    def _count(self, request: web.BaseRequest, status: int) -> None:
        method = request.method if request.method in _METHODS else "_OTHER"
        self.requests[(method, _template(request.path) or "other", str(status))] += 1

    async def _handle(self, request: web.BaseRequest) -> web.Response:
        incoming = request.headers.get("X-Request-Id")
        request_id = self._ids.accept(incoming)
        headers = {"X-Region": self.region, "X-Request-Id": request_id, "Cache-Control": "no-store"}
        try:
            route, params = self._resolve(request.method, request.path)
            if route.handler not in _OPEN:
                self._authenticate(request.headers.get("Authorization"))
            if route.write:
                return await self._write(request, route, params, headers, incoming)
            result = await self._read(route, params)
        except ApiError as exc:
            return self._respond(_Result(exc.status, exc.body(), exc.headers), headers, close=exc.status == 413)
        return self._respond(result, headers)

    def _respond(self, result: _Result, headers: dict[str, str], *, close: bool = False) -> web.Response:
        all_headers = {**headers, **(result.headers or {})}
        if result.payload is None:
            response = web.Response(status=result.status, headers=all_headers)
        else:
            body = result.payload if isinstance(result.payload, bytes) else _dumps(result.payload)
            response = web.Response(status=result.status, body=body, content_type=_JSON, headers=all_headers)
        if close:
            response.force_close()
        return response

    def _resolve(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        allowed: list[str] = []
        for route, pattern in _COMPILED:
            match = pattern.match(path)
            if match is None:
                continue
            if route.method == method:
                return route, match.groupdict()
            allowed.append(route.method)
        if allowed:
            raise ApiError(405, f"{method} is not allowed on {path[:200]}; allowed: {', '.join(allowed)}", None,
                           {"Allow": ", ".join(allowed)})
        raise ApiError(404, f"no such endpoint {path[:200]} (see /v1/openapi.json)", "path")

    def _authenticate(self, authorization: str | None) -> None:
        if self._token is None:
            if self._allow_unauthenticated:
                return
            raise ApiError(401, "the control API needs a bearer token file configured on this agent", "header."
                           "Authorization", {"WWW-Authenticate": 'Bearer realm="region-agent"'})
        if not authorization:
            raise ApiError(401, "missing Authorization: Bearer <token>", "header.Authorization",
                           {"WWW-Authenticate": 'Bearer realm="region-agent"'})
        if not self._token.accepts(authorization):
            raise ApiError(401, "the bearer token is not accepted", "header.Authorization",
                           {"WWW-Authenticate": 'Bearer realm="region-agent", error="invalid_token"'})

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        limit = self._max_body
        length = request.content_length
        if length is not None and length > limit:
            raise ApiError(413, f"the body is {length} bytes; at most {limit} are accepted", "$")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await request.content.read(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the body is more than {limit} bytes", "$")
            chunks.append(chunk)
        body = b"".join(chunks)
        if body.strip():
            content_type = request.headers.get("Content-Type", "")
            if content_type.split(";", 1)[0].strip().lower() != _JSON:
                raise ApiError(415, f"the body must be {_JSON}, not {content_type[:80] or 'untyped'}",
                               "header.Content-Type")
        return body

    def _idempotency_key(self, request: web.BaseRequest, incoming_id: str | None) -> str | None:
        key = request.headers.get("Idempotency-Key")
        if key is not None:
            if not _KEY_PATTERN.fullmatch(key):
                raise ApiError(400, "Idempotency-Key must be 1 to 255 visible ASCII characters",
                               "header.Idempotency-Key")
            return "key:" + key
        if incoming_id and is_valid_request_id(incoming_id):
            return "rid:" + incoming_id
        return None

    async def _write(self, request: web.BaseRequest, route: Route, params: dict[str, str],
                     headers: dict[str, str], incoming_id: str | None) -> web.Response:
        raw = await self._read_body(request)
        key = self._idempotency_key(request, incoming_id)
        data = parse_body(raw)
        print_ = fingerprint(route.method, request.path, json.dumps(data, sort_keys=True).encode())
        if key is not None:
            try:
                stored = self._idempotency.lookup(key, print_)
            except KeyConflictError:
                raise ApiError(409, "this idempotency key was used for another request", "header.Idempotency-Key"
                               if key.startswith("key:") else "header.X-Request-Id") from None
            if stored is not None:
                replay = _Result(stored.status, stored.body or None,
                                 {**dict(stored.headers), "Idempotent-Replayed": "true"})
                return self._respond(replay, headers)
        if not self._has_majority():
            raise ApiError(503, "this agent does not see a majority of regions alive: writes are refused until it "
                           "does (reads still work)", None,
                           {"Retry-After": str(self._retry_after), "X-Degraded": "true"})
        # From here to the store write nothing awaits: a retry with the same key can not interleave,
        # and the If-Match check below sees the version the write replaces.
        self._if_match = request.headers.get("If-Match")
        try:
            result = self._writes[route](params, data)
        finally:
            self._if_match = None
        if key is not None and 200 <= result.status < 300:
            body = b"" if result.payload is None else _dumps(result.payload)
            self._idempotency.store(key, print_, result.status, body, tuple((result.headers or {}).items()))
        return self._respond(result, headers)

    async def _read(self, route: Route, params: dict[str, str]) -> _Result:
        return await self._reads[route](params)

    def sweep_idempotency(self) -> int:
        """Delete replicated idempotency records past their time (the supervisor calls it periodically)."""
        return self._idempotency.sweep() if isinstance(self._idempotency, ReplicatedIdempotency) else 0

    def _put(self, items: list[tuple[Key, Value | None]]) -> None:
        self.store.put_many(items, writer=self.writer)

    def _etag(self, key: Key) -> dict[str, str]:
        entry = self.store.entry(key)
        return {} if entry is None or entry.value is None else {"ETag": etag(entry.version)}

    def _precondition(self, key: Key, field: str) -> None:
        """Refuse (412) a write whose If-Match names a version the resource no longer has."""
        wanted = self._if_match
        if wanted is None:
            return
        entry = self.store.entry(key)
        current = None if entry is None or entry.value is None else etag(entry.version)
        tags = [tag.strip() for tag in wanted.split(",")]
        if (tags == ["*"] and current is not None) or (current is not None and current in tags):
            return
        now = "it does not exist" if current is None else f"its ETag is now {current}"
        raise ApiError(412, f"If-Match {wanted[:100]} does not match: {now} (read it again, then write)",
                       "header.If-Match", {} if current is None else {"ETag": current})

    # --- reads --------------------------------------------------------------------------------

    async def _do_openapi(self, _params: dict[str, str]) -> _Result:
        return _Result(200, self._openapi_body)

    async def _do_list_projects(self, _params: dict[str, str]) -> _Result:
        projects, regions = self.store.projects, self.store.regions
        return _Result(200, {"projects": [_project_document(projects[slug], regions) for slug in sorted(projects)]})

    async def _do_get_project(self, params: dict[str, str]) -> _Result:
        slug = path_slug(params["slug"])
        project = self.store.projects.get(slug)
        if project is None:
            raise ApiError(404, f"no project {slug}", "path.slug")
        return _Result(200, _project_document(project, self.store.regions), self._etag(project_key(slug)))

    async def _do_list_regions(self, _params: dict[str, str]) -> _Result:
        regions, fenced = self.store.regions, self.store.fenced
        return _Result(200, {"regions": [regions[name].to_dict() for name in sorted(regions)],
                             "fenced": {name: fenced[name].reason for name in sorted(fenced)}})

    async def _do_get_region(self, params: dict[str, str]) -> _Result:
        name = path_region(params["name"])
        region = self.store.regions.get(name)
        if region is None:
            raise ApiError(404, f"no region {name}", "path.name")
        return _Result(200, region.to_dict(), self._etag(region_key(name)))

    async def _do_zone(self, _params: dict[str, str]) -> _Result:
        if self._zone is not None:
            document: object = self._zone()
        else:
            snapshot = self.store.snapshot()
            document = {
                "serial": zone_serial(snapshot), "digest": snapshot.digest,
                "regions": [r.to_dict() for _, r in sorted(snapshot.regions.items())],
                "projects": [p.to_dict() for _, p in sorted(snapshot.projects.items())],
                "fenced": [f.to_dict() for _, f in sorted(snapshot.fenced.items())],
            }
        # A zone of thousands of projects is a megabyte of JSON: encoded off the loop.
        return _Result(200, await asyncio.to_thread(_dumps, document))

    async def _do_members(self, _params: dict[str, str]) -> _Result:
        rows = sorted(self._members(), key=lambda row: row.name)
        regions: dict[str, bool] = {}
        for row in rows:
            regions[row.region] = regions.get(row.region, False) or row.live
        return _Result(200, {
            "region": self.region, "majority": self._has_majority(),
            "regions": {name: "alive" if alive else "silent" for name, alive in sorted(regions.items())},
            "members": [{
                "name": row.name, "region": row.region, "node": row.node, "role": row.role, "state": row.state,
                "since": row.since, "address": row.address, "incarnation": row.incarnation, "meta": dict(row.meta),
                "rtt_ms": None if row.rtt is None else round(row.rtt * 1000, 3),
            } for row in rows],
        })

    async def _do_digests(self, _params: dict[str, str]) -> _Result:
        local = self.store.digest()
        agents = sorted(self._digests().items())
        return _Result(200, {
            "region": self.region, "node": self.node, "digest": local,
            "agents": [{"member": name, "digest": digest, "same": digest == local} for name, digest in agents],
            "converged": all(digest == local for _, digest in agents),
        })

    # --- writes (synchronous: no await between the gate and the store) --------------------------

    def _do_put_project(self, params: dict[str, str], data: dict[str, Any]) -> _Result:
        slug = path_slug(params["slug"])
        project = parse_project(slug, data, self.store.regions.keys())
        self._precondition(project_key(slug), "path.slug")
        created = slug not in self.store.projects
        self._put([(project_key(slug), project)])
        headers = {"Location": f"/v1/projects/{slug}"} if created else {}
        return _Result(201 if created else 200, project.to_dict(), {**headers, **self._etag(project_key(slug))})

    def _do_delete_project(self, params: dict[str, str], data: dict[str, Any]) -> _Result:
        slug = path_slug(params["slug"])
        _no_body(data)
        if slug not in self.store.projects:
            raise ApiError(404, f"no project {slug}", "path.slug")
        self._precondition(project_key(slug), "path.slug")
        self._put([(project_key(slug), None)])
        return _Result(204)

    def _do_put_region(self, params: dict[str, str], data: dict[str, Any]) -> _Result:
        name = path_region(params["name"])
        region = parse_region(name, data)
        self._precondition(region_key(name), "path.name")
        created = name not in self.store.regions
        self._put([(region_key(name), region)])
        headers = {"Location": f"/v1/regions/{name}"} if created else {}
        return _Result(201 if created else 200, region.to_dict(), {**headers, **self._etag(region_key(name))})

    def _do_delete_region(self, params: dict[str, str], data: dict[str, Any]) -> _Result:
        name = path_region(params["name"])
        _no_body(data)
        if name not in self.store.regions:
            raise ApiError(404, f"no region {name}", "path.name")
        self._precondition(region_key(name), "path.name")
        users = sorted(slug for slug, project in self.store.projects.items() if name in project.regions)
        if users:
            shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
            raise ApiError(409, f"region {name} is a region of project(s) {shown}: change them first", "path.name")
        self._put([(region_key(name), None)])
        return _Result(204)

    def _do_fence(self, params: dict[str, str], data: dict[str, Any]) -> _Result:
        name = path_region(params["name"])
        fence = parse_fence(name, data)
        if name not in self.store.regions:
            raise ApiError(404, f"no region {name}", "path.name")
        self._put([(fence_key(name), fence)])
        return _Result(200, {"region": name, "fenced": True, "reason": fence.reason})

    def _do_unfence(self, params: dict[str, str], data: dict[str, Any]) -> _Result:
        name = path_region(params["name"])
        _no_body(data)
        if name not in self.store.regions and name not in self.store.fenced:
            raise ApiError(404, f"no region {name}", "path.name")
        self._put([(fence_key(name), None)])
        return _Result(200, {"region": name, "fenced": False, "reason": ""})


def _no_body(data: Mapping[str, Any]) -> None:
    for key in data:
        raise ApiError(422, f"unknown field {key!r}: this request takes no body", f"$.{key}")

