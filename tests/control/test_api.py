"""The control API as the control plane calls it: aiohttp's test client against ControlAPI.install."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from region_agent.base.bearer import BearerToken
from region_agent.base.request_ids import is_valid_request_id
from region_agent.cluster.members import MemberRow, member_rows
from region_agent.control import PREFIX, ROUTES, ControlAPI, IdempotencyCache
from region_agent.control.api import Route, etag
from region_agent.control.validation import json_depth
from region_agent.globaldns.compiler import ZoneConfig, compile_zone
from region_agent.gossip.membership import MemberView
from region_agent.gossip.messages import Address, Member, Role, State
from region_agent.health.listener import HealthListener
from region_agent.health.listener import Role as ListenerRole
from region_agent.health.settings import HealthSettings
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, copy_key, fence_key, project_key, region_key
from region_agent.state.store import Store

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONFIG = ZoneConfig("g.example.com")
SFO = {"ipv4": ["192.0.2.1"], "ipv6": ["2001:db8::1"], "ns_ipv4": ["192.0.2.53"], "latitude": 37.6,
       "longitude": -122.4}
AMS = {"ipv4": ["198.51.100.1"], "latitude": 52.3, "longitude": 4.8}

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[[web.Application], Awaitable[Client]]


@dataclass
class Cluster:
    """The API's collaborators, controllable by the test."""

    store: Store
    majority: bool = True
    members: list[MemberRow] = field(default_factory=list)
    digests: dict[str, str | None] = field(default_factory=dict)

    def api(self, token: BearerToken | None, **kwargs: Any) -> ControlAPI:
        return ControlAPI(store=self.store, node="n1", region="sfo1", members=lambda: self.members,
                          has_majority=lambda: self.majority, digests=lambda: self.digests, token=token, **kwargs)


def _member(region: str, node: str, state: State, role: Role = Role.AGENT) -> MemberRow:
    view = MemberView(Member(f"{region}-{node}", region, node, role, Address("127.0.0.1", 7946)), state, 12.5)
    return member_rows([view], since_wall=lambda v: v.since, rtt=lambda _name: None)[0]


@pytest.mark.parametrize("routes", [
    (*ROUTES, Route("GET", "/v1/extra", "extra")),  # a route without a handler
    tuple(route for route in ROUTES if route.handler != "members"),  # a handler without a route
    tuple(Route(r.method, r.template, r.handler, write=not r.write) if r.handler == "fence" else r
          for r in ROUTES),  # a write answered by a read, or the reverse
], ids=["no handler", "no route", "read or write"])
def test_routes_and_handlers_are_checked_when_the_api_is_built(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch, routes: tuple[Route, ...]) -> None:
    monkeypatch.setattr("region_agent.control.api.ROUTES", routes)
    with pytest.raises(LookupError, match="handlers and ROUTES disagree"):
        cluster.api(None)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def cluster() -> Cluster:
    ms = iter(range(1_800_000_000_000, 1_900_000_000_000, 1000))
    return Cluster(Store(writer="sfo1/n1", clock=HybridClock(lambda: next(ms))))


@pytest.fixture
async def client(aiohttp_client: MakeClient, cluster: Cluster, token_file: Path) -> Client:
    app = web.Application()
    cluster.api(BearerToken(token_file)).install(app)
    return await aiohttp_client(app)


async def _call(client: Client, method: str, path: str, body: object = None, *, headers: dict[str, str] | None = None,
                raw: bytes | None = None) -> tuple[int, Any, Any]:
    """(status, JSON body or None, headers); every answer must carry X-Region and a request id."""
    all_headers = {**AUTH, **(headers or {})}
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    if data is not None:
        all_headers.setdefault("Content-Type", "application/json")
    async with client.request(method, path, data=data, headers=all_headers) as response:
        text = await response.read()
        assert response.headers["X-Region"] == "sfo1"
        assert is_valid_request_id(response.headers["X-Request-Id"])
        payload = json.loads(text) if text else None
        return response.status, payload, response.headers


async def _setup_regions(client: Client) -> None:
    assert (await _call(client, "PUT", "/v1/regions/sfo1", SFO))[0] == 201
    assert (await _call(client, "PUT", "/v1/regions/ams1", AMS))[0] == 201


# --- auth ------------------------------------------------------------------------------------


async def test_auth_is_required_except_for_the_document(client: Client, cluster: Cluster) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": "Basic eA=="}):
        async with client.put("/v1/regions/sfo1", json=SFO, headers=headers) as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            assert response.headers["X-Region"] == "sfo1"
            body = await response.json()
            assert body["field"] == "header.Authorization" and body["error"]
        async with client.get("/v1/projects", headers=headers) as response:
            assert response.status == 401
    assert len(cluster.store) == 0
    async with client.get("/v1/openapi.json") as response:
        assert response.status == 200
        assert (await response.json())["openapi"] == "3.1.0"


async def test_a_rotated_token_file_is_read_again(client: Client, token_file: Path) -> None:
    import os
    token_file.write_text("rotated\n")
    stat = token_file.stat()
    os.utime(token_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    api_token = BearerToken(token_file)
    assert api_token.accepts("Bearer rotated") and not api_token.accepts(f"Bearer {TOKEN}")


async def test_without_a_token_file_everything_is_refused(aiohttp_client: MakeClient, cluster: Cluster) -> None:
    app = web.Application()
    cluster.api(None).install(app)
    client = await aiohttp_client(app)
    status, body, _ = await _call(client, "GET", "/v1/regions")
    assert status == 401 and "token" in body["error"]
    open_app = web.Application()
    cluster.api(None, allow_unauthenticated=True).install(open_app)
    assert (await _call(await aiohttp_client(open_app), "GET", "/v1/regions"))[0] == 200


# --- every 4xx names the field and changes nothing ---------------------------------------------

BAD: list[tuple[str, str, object, bytes | None, dict[str, str], int, str]] = [
    # (method, path, body, raw bytes, extra headers, status, field)
    ("PUT", "/v1/projects/shop", None, b"{not json", {}, 400, "$"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1"]}, None, {"Idempotency-Key": "has space"}, 400,
     "header.Idempotency-Key"),
    ("GET", "/v1/projects/nope", None, None, {}, 404, "path.slug"),
    ("DELETE", "/v1/projects/nope", None, None, {}, 404, "path.slug"),
    ("GET", "/v1/regions/lax1", None, None, {}, 404, "path.name"),
    ("POST", "/v1/regions/lax1/fence", None, None, {}, 404, "path.name"),
    ("POST", "/v1/regions/lax1/unfence", None, None, {}, 404, "path.name"),
    ("GET", "/v1/nothing", None, None, {}, 404, "path"),
    ("DELETE", "/v1/regions/sfo1", None, None, {}, 409, "path.name"),  # shop uses it
    ("PUT", "/v1/projects/shop", None, b'{"regions": ["sfo1"]}', {"Content-Type": "text/plain"}, 415,
     "header.Content-Type"),
    ("PUT", "/v1/projects/shop", None, b"[1]", {"Content-Type": "application/json"}, 422, "$"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1"], "colour": "red"}, None, {}, 422, "$.colour"),
    ("PUT", "/v1/projects/shop", {}, None, {}, 422, "$.regions"),
    ("PUT", "/v1/projects/shop", {"regions": "sfo1"}, None, {}, 422, "$.regions"),
    ("PUT", "/v1/projects/shop", {"regions": []}, None, {}, 422, "$.regions"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1", "lax1"]}, None, {}, 422, "$.regions[1]"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1", "SFO"]}, None, {}, 422, "$.regions[1]"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1", 7]}, None, {}, 422, "$.regions[1]"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1", "sfo1"]}, None, {}, 422, "$.regions[1]"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1"], "primary": "ams1"}, None, {}, 422, "$.primary"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1"], "primary": 1}, None, {}, 422, "$.primary"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1"], "mode": "closest"}, None, {}, 422, "$.mode"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1"], "all_down": "none"}, None, {}, 422, "$.all_down"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1"], "partition": "maybe"}, None, {}, 422, "$.partition"),
    ("PUT", "/v1/projects/shop", {"regions": ["sfo1"], "slug": "blog"}, None, {}, 422, "$.slug"),
    ("PUT", "/v1/projects/-bad-", {"regions": ["sfo1"]}, None, {}, 422, "path.slug"),
    ("GET", "/v1/projects/Bad_Slug", None, None, {}, 422, "path.slug"),
    ("PUT", "/v1/regions/lax", {}, None, {}, 422, "path.name"),
    ("PUT", "/v1/regions/lax1", {"ipv4": ["2001:db8::1"]}, None, {}, 422, "$.ipv4[0]"),
    ("PUT", "/v1/regions/lax1", {"ipv4": ["192.0.2.1", "300.1.1.1"]}, None, {}, 422, "$.ipv4[1]"),
    ("PUT", "/v1/regions/lax1", {"ns_ipv6": "2001:db8::1"}, None, {}, 422, "$.ns_ipv6"),
    ("PUT", "/v1/regions/lax1", {"latitude": 10}, None, {}, 422, "$.longitude"),
    ("PUT", "/v1/regions/lax1", {"latitude": 91, "longitude": 0}, None, {}, 422, "$.latitude"),
    ("PUT", "/v1/regions/lax1", {"latitude": True, "longitude": 0}, None, {}, 422, "$.latitude"),
    ("PUT", "/v1/regions/lax1", {"latitude": 1, "longitude": "0"}, None, {}, 422, "$.longitude"),
    ("PUT", "/v1/regions/lax1", None, b'{"latitude": NaN, "longitude": 0}', {"Content-Type": "application/json"},
     400, "$"),
    ("PUT", "/v1/regions/lax1", {"name": "sfo1"}, None, {}, 422, "$.name"),
    ("PUT", "/v1/regions/lax1", None, b"[" * 1000 + b"]" * 1000, {"Content-Type": "application/json"}, 400, "$"),
    ("PUT", "/v1/regions/lax1", None, b'{"ipv4": ' + b"[" * 17 + b"]" * 17 + b"}",
     {"Content-Type": "application/json"}, 400, "$"),
    ("PUT", "/v1/projects/shop", None, b'{"regions": ["sfo1"], "regions": ["ams1"]}',
     {"Content-Type": "application/json"}, 400, "$"),
    ("PUT", "/v1/regions/lax1", {"ipv4": ["0.0.0.0"]}, None, {}, 422, "$.ipv4[0]"),
    ("PUT", "/v1/regions/lax1", {"ipv4": ["192.0.2.1", "255.255.255.255"]}, None, {}, 422, "$.ipv4[1]"),
    ("PUT", "/v1/regions/lax1", {"ipv4": ["169.254.0.1"]}, None, {}, 422, "$.ipv4[0]"),
    ("PUT", "/v1/regions/lax1", {"ipv6": ["::"]}, None, {}, 422, "$.ipv6[0]"),
    ("PUT", "/v1/regions/lax1", {"ns_ipv4": ["224.0.0.1"]}, None, {}, 422, "$.ns_ipv4[0]"),
    ("PUT", "/v1/regions/lax1", {"ns_ipv6": ["ff02::1"]}, None, {}, 422, "$.ns_ipv6[0]"),
    ("PUT", "/v1/regions/" + "lax" + "1" * 58, {}, None, {}, 422, "path.name"),
    ("PUT", "/v1/regions/lax1", {"location": "LA"}, None, {}, 422, "$.location"),
    ("POST", "/v1/regions/sfo1/fence", {"reason": 5}, None, {}, 422, "$.reason"),
    ("POST", "/v1/regions/sfo1/fence", {"reason": "x" * 300}, None, {}, 422, "$.reason"),
    ("POST", "/v1/regions/sfo1/fence", {"why": "x"}, None, {}, 422, "$.why"),
    ("POST", "/v1/regions/sfo1/unfence", {"reason": "x"}, None, {}, 422, "$.reason"),
    ("DELETE", "/v1/projects/shop", {"force": True}, None, {}, 422, "$.force"),
]


@pytest.mark.parametrize(("method", "path", "body", "raw", "headers", "status", "field"), BAD,
                         ids=[f"{b[5]} {b[0]} {b[1]} {b[6]}" for b in BAD])
async def test_bad_requests_name_the_field_and_change_nothing(
        client: Client, cluster: Cluster, method: str, path: str, body: object, raw: bytes | None,
        headers: dict[str, str], status: int, field: str) -> None:
    await _setup_regions(client)
    assert (await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1", "ams1"]}))[0] == 201
    digest, size = cluster.store.digest(), len(cluster.store)
    got, payload, _ = await _call(client, method, path, body, headers=headers, raw=raw)
    assert (got, payload["field"]) == (status, field), payload
    assert isinstance(payload["error"], str) and payload["error"]
    assert set(payload) == {"error", "field"}
    assert (cluster.store.digest(), len(cluster.store)) == (digest, size)


async def test_method_not_allowed_lists_the_allowed_ones(client: Client) -> None:
    status, payload, headers = await _call(client, "PATCH", "/v1/projects/shop", {"mode": "ha"})
    assert status == 405 and headers["Allow"] == "GET, PUT, DELETE" and payload["field"] is None
    status, _, headers = await _call(client, "GET", "/v1/regions/sfo1/fence")
    assert status == 405 and headers["Allow"] == "POST"


async def test_bodies_are_bounded(aiohttp_client: MakeClient, cluster: Cluster, token_file: Path) -> None:
    app = web.Application()
    cluster.api(BearerToken(token_file), max_body_bytes=1024).install(app)
    client = await aiohttp_client(app)
    big = {"ipv4": ["192.0.2.1"] * 200}
    status, payload, _ = await _call(client, "PUT", "/v1/regions/sfo1", big)
    assert (status, payload["field"]) == (413, "$")

    async def chunks() -> Any:  # no Content-Length: counted while read
        for _ in range(20):
            yield b" " * 100

    async with client.put("/v1/regions/sfo1", data=chunks(),
                          headers={**AUTH, "Content-Type": "application/json"}) as response:
        assert response.status == 413
    assert len(cluster.store) == 0


# --- writes -----------------------------------------------------------------------------------


async def test_a_created_project_is_answered_by_the_zone_compiler(client: Client, cluster: Cluster) -> None:
    await _setup_regions(client)
    status, body, headers = await _call(client, "PUT", "/v1/projects/shop",
                                        {"regions": ["sfo1", "ams1"], "mode": "ha", "all_down": "all"})
    assert status == 201 and headers["Location"] == "/v1/projects/shop"
    assert body == {"slug": "shop", "regions": ["sfo1", "ams1"], "primary": "sfo1", "mode": "ha", "all_down": "all"}
    entry = cluster.store.entry(project_key("shop"))
    assert entry is not None and entry.version.writer == "control/sfo1.n1"
    assert (await _call(client, "GET", "/v1/projects/shop"))[1] == body
    cluster.store.put(copy_key("shop", "sfo1"), CopyHealth(True))  # the region reports its copy serving
    tables = compile_zone(cluster.store.snapshot(), CONFIG)
    answers = tables.projects["shop"].description["answers"]
    assert answers == {"A": {"addresses": ["192.0.2.1"], "why": "primary healthy", "outcome": "answer"},
                       "AAAA": {"addresses": ["2001:db8::1"], "why": "primary healthy", "outcome": "answer"}}
    # Replace (200), list, delete (204), gone (404).
    status, body, _ = await _call(client, "PUT", "/v1/projects/shop", {"regions": ["ams1", "sfo1"]})
    assert status == 200 and body["primary"] == "ams1"
    assert [p["slug"] for p in (await _call(client, "GET", "/v1/projects"))[1]["projects"]] == ["shop"]
    assert (await _call(client, "DELETE", "/v1/projects/shop"))[:2] == (204, None)
    assert (await _call(client, "GET", "/v1/projects/shop"))[0] == 404
    assert "shop" not in compile_zone(cluster.store.snapshot(), CONFIG).projects
    # A project's own partition policy round-trips; absent means the zone's.
    status, body, _ = await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1"], "partition": "failover"})
    assert status == 201 and body["partition"] == "failover"
    assert cluster.store.projects["shop"].partition == "failover"


async def test_a_project_naming_a_region_gone_elsewhere_shows_the_problem(client: Client, cluster: Cluster) -> None:
    await _setup_regions(client)
    assert (await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1", "ams1"]}))[0] == 201
    assert "problems" not in (await _call(client, "GET", "/v1/projects/shop"))[1]
    # Another agent deleted the region while this one still had the project (the 409 rule is per agent).
    cluster.store.put_many([(region_key("ams1"), None)], writer="control/fra1.n2")
    status, body, _ = await _call(client, "GET", "/v1/projects/shop")
    assert status == 200 and body["problems"] == ["region ams1 is not configured: left out of the answers"]
    listed = (await _call(client, "GET", "/v1/projects"))[1]["projects"]
    assert listed[0]["problems"] == body["problems"]
    # What GET gives, PUT takes: problems is read-only and ignored; the unknown region is still refused.
    assert (await _call(client, "PUT", "/v1/projects/shop", body))[0] == 422
    fixed = {**body, "regions": ["sfo1"]}
    status, body, _ = await _call(client, "PUT", "/v1/projects/shop", fixed)
    assert status == 200 and "problems" not in body and cluster.store.projects["shop"].regions == ("sfo1",)


async def test_requests_are_counted_by_method_route_and_status(aiohttp_client: MakeClient, cluster: Cluster,
                                                                token_file: Path) -> None:
    registry = CollectorRegistry()
    app = web.Application()
    cluster.api(BearerToken(token_file), registry=registry).install(app)
    client = await aiohttp_client(app)
    await _setup_regions(client)
    assert (await _call(client, "GET", "/v1/projects/nope"))[0] == 404
    assert (await _call(client, "GET", "/v1/nothing-here"))[0] == 404
    async with client.get("/v1/regions") as response:   # no token
        assert response.status == 401

    def count(method: str, route: str, status: str) -> float | None:
        return registry.get_sample_value("region_agent_control_requests_total",
                                         {"method": method, "route": route, "status": status})
    assert count("PUT", "/v1/regions/{name}", "201") == 2
    assert count("GET", "/v1/projects/{slug}", "404") == 1
    assert count("GET", "other", "404") == 1
    assert count("GET", "/v1/regions", "401") == 1


async def test_regions_round_trip_and_delete(client: Client, cluster: Cluster) -> None:
    await _setup_regions(client)
    status, body, _ = await _call(client, "GET", "/v1/regions/sfo1")
    assert status == 200 and body == {"name": "sfo1", "ns_ipv6": [], **SFO, "witness": False}
    status, body, _ = await _call(client, "PUT", "/v1/regions/sfo1", body)  # what GET gives, PUT takes
    assert status == 200
    listing = (await _call(client, "GET", "/v1/regions"))[1]
    assert [r["name"] for r in listing["regions"]] == ["ams1", "sfo1"] and listing["fenced"] == {}
    assert (await _call(client, "DELETE", "/v1/regions/ams1"))[0] == 204
    assert "ams1" not in cluster.store.regions
    assert cluster.store.entry(("region", "sfo1")).version.writer == "control/sfo1.n1"  # type: ignore[union-attr]


async def test_loopback_addresses_stay_accepted(client: Client, cluster: Cluster) -> None:
    """The laptop demo and the process tests run every region on 127.0.0.x."""
    body = {"ipv4": ["127.0.0.2"], "ipv6": ["::1"], "ns_ipv4": ["127.0.0.53"]}
    assert (await _call(client, "PUT", "/v1/regions/lax1", body))[0] == 201
    assert cluster.store.regions["lax1"].ns_ipv4 == ("127.0.0.53",)


async def test_fence_and_unfence(client: Client, cluster: Cluster) -> None:
    await _setup_regions(client)
    await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1", "ams1"]})
    cluster.store.put(copy_key("shop", "sfo1"), CopyHealth(True))
    cluster.store.put_many([(copy_key("shop", "ams1"), CopyHealth(True))], writer="ams1/n1")
    status, body, _ = await _call(client, "POST", "/v1/regions/sfo1/fence", {"reason": "maintenance"})
    assert (status, body) == (200, {"region": "sfo1", "fenced": True, "reason": "maintenance"})
    assert cluster.store.fenced["sfo1"].reason == "maintenance"
    assert cluster.store.entry(fence_key("sfo1")).version.writer == "control/sfo1.n1"  # type: ignore[union-attr]
    answers = compile_zone(cluster.store.snapshot(), CONFIG).projects["shop"].description["answers"]
    assert answers["A"]["addresses"] == ["198.51.100.1"]  # type: ignore[index]
    assert (await _call(client, "GET", "/v1/regions"))[1]["fenced"] == {"sfo1": "maintenance"}
    status, body, _ = await _call(client, "POST", "/v1/regions/sfo1/unfence")
    assert (status, body) == (200, {"region": "sfo1", "fenced": False, "reason": ""})
    assert not cluster.store.fenced
    assert (await _call(client, "POST", "/v1/regions/sfo1/unfence"))[0] == 200  # again: nothing changes
    assert (await _call(client, "POST", "/v1/regions/ams1/fence"))[1]["reason"] == ""  # no body, no reason


# --- idempotency --------------------------------------------------------------------------------


async def test_a_retried_write_replays_its_answer(client: Client, cluster: Cluster) -> None:
    await _setup_regions(client)
    key = {"Idempotency-Key": "create-shop-1"}
    first = await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1"]}, headers=key)
    version = cluster.store.entry(project_key("shop"))
    # Meanwhile someone else changed it: the retry must not put the old value back.
    await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1", "ams1"]})
    changed = cluster.store.entry(project_key("shop"))
    again = await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1"]}, headers=key)
    assert (again[0], again[1]) == (first[0], first[1]) == (201, first[1])
    assert again[2]["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first[2]
    assert again[2]["Location"] == "/v1/projects/shop"
    assert cluster.store.entry(project_key("shop")) == changed != version
    # The same key with another request: 409, nothing changes.
    status, body, _ = await _call(client, "PUT", "/v1/projects/shop", {"regions": ["ams1"]}, headers=key)
    assert (status, body["field"]) == (409, "header.Idempotency-Key")
    assert cluster.store.entry(project_key("shop")) == changed
    # The same JSON written differently is the same request.
    raw = b'{ "regions" : [ "sfo1" ] }'
    status, _, headers = await _call(client, "PUT", "/v1/projects/shop", raw=raw,
                                     headers={**key, "Content-Type": "application/json"})
    assert status == 201 and headers["Idempotent-Replayed"] == "true"


async def test_a_request_id_serves_as_the_key_and_deletes_replay_too(client: Client, cluster: Cluster) -> None:
    await _setup_regions(client)
    await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1"]})
    rid = {"X-Request-Id": "req_iad1-1800000000000-0123456789ab"}
    first = await _call(client, "DELETE", "/v1/projects/shop", headers=rid)
    assert first[0] == 204 and first[2]["X-Request-Id"] == rid["X-Request-Id"]
    again = await _call(client, "DELETE", "/v1/projects/shop", headers=rid)
    assert again[0] == 204 and again[2]["Idempotent-Replayed"] == "true"
    assert (await _call(client, "DELETE", "/v1/projects/shop"))[0] == 404  # without the id: it runs, and 404
    status, body, _ = await _call(client, "DELETE", "/v1/projects/blog", headers=rid)
    assert (status, body["field"]) == (409, "header.X-Request-Id")


async def test_failures_are_not_replayed(client: Client, cluster: Cluster) -> None:
    key = {"Idempotency-Key": "k1"}
    assert (await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1"]}, headers=key))[0] == 422
    await _setup_regions(client)
    assert (await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1"]}, headers=key))[0] == 201


def test_the_idempotency_cache_is_bounded_in_size_and_time() -> None:
    now = [0.0]
    cache = IdempotencyCache(max_entries=3, ttl=60.0, monotonic=lambda: now[0])
    for n in range(4):
        cache.store(f"k{n}", "p", 200, b"{}", ())
    assert len(cache) == 3 and cache.lookup("k0", "p") is None
    assert cache.lookup("k1", "p") is not None  # now the most recently used
    cache.store("k4", "p", 200, b"{}", ())
    assert cache.lookup("k2", "p") is None and cache.lookup("k1", "p") is not None
    now[0] = 61.0
    assert cache.lookup("k1", "p") is None
    cache.store("k5", "p", 200, b"{}", ())
    assert len(cache) == 1  # the expired ones went
    with pytest.raises(ValueError):
        IdempotencyCache(max_entries=0)


# --- the write gate -------------------------------------------------------------------------------


async def test_writes_need_a_majority_reads_do_not(client: Client, cluster: Cluster) -> None:
    await _setup_regions(client)
    key = {"Idempotency-Key": "before"}
    assert (await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1"]}, headers=key))[0] == 201
    cluster.majority = False
    digest = cluster.store.digest()
    for method, path, body in (("PUT", "/v1/projects/blog", {"regions": ["sfo1"]}),
                               ("DELETE", "/v1/projects/shop", None), ("PUT", "/v1/regions/lax1", {}),
                               ("DELETE", "/v1/regions/ams1", None), ("POST", "/v1/regions/sfo1/fence", None),
                               ("POST", "/v1/regions/sfo1/unfence", None)):
        status, payload, headers = await _call(client, method, path, body)
        assert status == 503, (method, path)
        assert headers["Retry-After"] == "5" and headers["X-Degraded"] == "true"
        assert "majority" in payload["error"]
    assert cluster.store.digest() == digest
    for path in ("/v1/projects/shop", "/v1/projects", "/v1/regions", "/v1/zone", "/v1/members", "/v1/digests"):
        assert (await _call(client, "GET", path))[0] == 200, path
    # A retry of a write that was applied before the partition still gets its answer.
    assert (await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1"]}, headers=key))[0] == 201
    cluster.majority = True
    assert (await _call(client, "PUT", "/v1/projects/blog", {"regions": ["sfo1"]}))[0] == 201


# --- reads ----------------------------------------------------------------------------------------


async def test_members_digests_and_zone(client: Client, cluster: Cluster) -> None:
    await _setup_regions(client)
    cluster.members = [_member("sfo1", "n1", State.ALIVE), _member("ams1", "n1", State.DEAD),
                       _member("ams1", "n2", State.SUSPECT), _member("nrt1", "n1", State.DEAD),
                       _member("wit1", "w", State.ALIVE, Role.WITNESS)]
    status, body, _ = await _call(client, "GET", "/v1/members")
    assert status == 200 and body["majority"] is True
    assert body["regions"] == {"ams1": "alive", "nrt1": "silent", "sfo1": "alive", "wit1": "alive"}
    assert body["members"][0] == {"name": "ams1-n1", "region": "ams1", "node": "n1", "role": "agent",
                                  "state": "dead", "since": 12.5, "address": "127.0.0.1:7946", "incarnation": 0,
                                  "meta": {}, "rtt_ms": None}
    assert body["members"][-1]["role"] == "witness"
    local = cluster.store.digest()
    cluster.digests = {"ams1-n2": local, "sfo1-n1": local}
    body = (await _call(client, "GET", "/v1/digests"))[1]
    assert body["digest"] == local and body["converged"] is True
    cluster.digests["nrt1-n1"] = None
    body = (await _call(client, "GET", "/v1/digests"))[1]
    assert body["converged"] is False and body["agents"][1] == {"member": "nrt1-n1", "digest": None, "same": False}
    body = (await _call(client, "GET", "/v1/zone"))[1]
    assert body["digest"] == local and [r["name"] for r in body["regions"]] == ["ams1", "sfo1"]


async def test_the_zone_document_comes_from_the_agent(aiohttp_client: MakeClient, cluster: Cluster,
                                                      token_file: Path) -> None:
    app = web.Application()
    cluster.api(BearerToken(token_file), zone=lambda: {"zone": "g.example.com", "serial": 7, "records": []}).install(
        app)
    client = await aiohttp_client(app)
    assert (await _call(client, "GET", "/v1/zone"))[1] == {"zone": "g.example.com", "serial": 7, "records": []}


# --- through the operator listener -------------------------------------------------------------------


async def test_the_operator_listener_hands_v1_to_the_api(cluster: Cluster, token_file: Path) -> None:
    settings = HealthSettings(listen_addresses=("127.0.0.1",), port=0, operator_port=0,
                              operator_token_file=token_file)
    api = cluster.api(BearerToken(token_file))
    registry = CollectorRegistry()
    listener = HealthListener(region="sfo1", source=lambda: None, settings=settings, registry=registry,
                              role=ListenerRole.OPERATOR, handlers={PREFIX: api.handle})
    await listener.start()
    try:
        host, port = listener.addresses[0]
        base = f"http://{host}:{port}"
        async with aiohttp.ClientSession() as session:
            async with session.put(f"{base}/v1/regions/sfo1", json=SFO, headers=AUTH) as response:
                assert response.status == 201 and response.headers["X-Region"] == "sfo1"
            async with session.put(f"{base}/v1/regions/sfo1", json=SFO) as response:
                assert response.status == 401 and (await response.json())["field"] == "header.Authorization"
            async with session.get(f"{base}/v1/openapi.json") as response:
                assert response.status == 200
            async with session.get(f"{base}/livez") as response:  # the listener's own paths are untouched
                assert response.status == 200
        assert "sfo1" in cluster.store.regions
        assert listener.stats.count("api", 201) == 1 and listener.stats.count("api", 401) == 1
    finally:
        await listener.stop()
    with pytest.raises(ValueError, match="operator"):
        HealthListener(region="sfo1", source=lambda: None, settings=settings, registry=CollectorRegistry(),
                       handlers={PREFIX: api.handle})


async def test_read_modify_write_with_if_match_refuses_a_write_made_meanwhile(client: Client, cluster: Cluster) -> None:
    """Two operators read the project, both change it: the second write names the version it read and gets
    412 (nothing changed), instead of silently undoing the first."""
    await _setup_regions(client)
    status, _, headers = await _call(client, "PUT", "/v1/projects/shop", {"regions": ["sfo1", "ams1"]})
    assert status == 201 and headers["ETag"].startswith('"')
    status, body, headers = await _call(client, "GET", "/v1/projects/shop")
    read = headers["ETag"]
    first = await _call(client, "PUT", "/v1/projects/shop", {**body, "primary": "ams1"}, headers={"If-Match": read})
    assert first[0] == 200 and first[2]["ETag"] != read
    late = await _call(client, "PUT", "/v1/projects/shop", {**body, "primary": "sfo1"}, headers={"If-Match": read})
    assert late[0] == 412 and late[1]["field"] == "header.If-Match" and late[2]["ETag"] == first[2]["ETag"]
    assert cluster.store.projects["shop"].primary == "ams1"
    assert (await _call(client, "DELETE", "/v1/projects/shop", headers={"If-Match": read}))[0] == 412
    assert (await _call(client, "PUT", "/v1/projects/blog", {"regions": ["sfo1"]}, headers={"If-Match": "*"}))[0] == 412
    assert "blog" not in cluster.store.projects
    assert (await _call(client, "DELETE", "/v1/projects/shop", headers={"If-Match": first[2]["ETag"]}))[0] == 204


def test_an_etag_is_the_same_at_every_agent_holding_the_version() -> None:
    """So a read at one agent and a write at another (any agent takes writes) still compare versions."""
    ms = iter(range(1_800_000_000_000, 1_900_000_000_000, 1000))
    here = Store(writer="sfo1/n1", clock=HybridClock(lambda: next(ms)))
    there = Store(writer="ams1/n1", clock=HybridClock(lambda: next(ms)))
    here.put_many([(project_key("shop"), Project("shop", ("sfo1",)))], writer="control/sfo1.n1")
    there.merge(here.entries())
    a, b = here.entry(project_key("shop")), there.entry(project_key("shop"))
    assert a is not None and b is not None and etag(a.version) == etag(b.version)


async def test_a_retry_replays_at_another_agent_and_after_a_restart(aiohttp_client: MakeClient,
                                                                   token_file: Path) -> None:
    """The idempotency record travels with the store: a retry sent to another agent (or to this one after a
    restart) replays the first answer; a retried DELETE answers its 204 again, not 404."""
    ms = iter(range(1_800_000_000_000, 1_900_000_000_000, 1000))
    here = Cluster(Store(writer="sfo1/n1", clock=HybridClock(lambda: next(ms))))
    there = Cluster(Store(writer="ams1/n1", clock=HybridClock(lambda: next(ms))))
    app_here, app_there = web.Application(), web.Application()
    here.api(BearerToken(token_file)).install(app_here)
    there.api(BearerToken(token_file)).install(app_there)
    a, b = await aiohttp_client(app_here), await aiohttp_client(app_there)
    await _setup_regions(a)
    key = {"Idempotency-Key": "create-shop-1"}
    first = await _call(a, "PUT", "/v1/projects/shop", {"regions": ["sfo1", "ams1"]}, headers=key)
    assert first[0] == 201
    there.store.merge(here.store.entries())                      # gossip carried the write and its record
    retry = await _call(b, "PUT", "/v1/projects/shop", {"regions": ["sfo1", "ams1"]}, headers=key)
    assert retry[0] == 201 and retry[2].get("Idempotent-Replayed") == "true" and retry[1] == first[1]
    conflict = await _call(b, "PUT", "/v1/projects/shop", {"regions": ["sfo1"]}, headers=key)
    assert conflict[0] == 409
    delete = {"Idempotency-Key": "delete-shop-1"}
    assert (await _call(b, "DELETE", "/v1/projects/shop", headers=delete))[0] == 204
    here.store.merge(there.store.entries())
    again = await _call(a, "DELETE", "/v1/projects/shop", headers=delete)
    assert again[0] == 204 and again[2].get("Idempotent-Replayed") == "true"
    # A restart: a new API over the same store (what the snapshot brings back) replays too.
    restarted = web.Application()
    here.api(BearerToken(token_file)).install(restarted)
    c = await aiohttp_client(restarted)
    assert (await _call(c, "DELETE", "/v1/projects/shop", headers=delete))[2].get("Idempotent-Replayed") == "true"


def test_the_depth_count_is_linear_in_the_body() -> None:
    """A body of escaped quotes with no closing one made every quote scan to the end: 17 s for 64 KiB."""
    hostile = b'"' + b'\\"' * 32_000   # 64 KiB, the body bound
    started = time.perf_counter()
    assert json_depth(hostile) == 0
    assert time.perf_counter() - started < 0.5
    assert json_depth(b'{"a": "x[[[\\"]]", "b": [[1]]}') == 3   # brackets in strings, escapes, do not count
    assert json_depth(b"[" * 40 + b"]" * 40, stop_above=16) == 17
