"""The checked-in OpenAPI document and the API agree: routes both ways, statuses and body schemas."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient
from jsonschema import Draft202012Validator

from region_agent.base.bearer import BearerToken
from region_agent.control import ROUTES, ControlAPI, load_openapi
from region_agent.control.api import FALLBACK
from region_agent.state.hlc import HybridClock
from region_agent.state.store import Store

Client = TestClient[web.Request, web.Application]
DOC = load_openapi()
METHODS = ("get", "put", "post", "delete", "patch")


def _api(tmp_path: Path, *, majority: bool = True) -> ControlAPI:
    token = tmp_path / "token"
    token.write_text("t")
    ms = iter(range(1_800_000_000_000, 1_900_000_000_000, 1000))
    store = Store(writer="sfo1/n1", clock=HybridClock(lambda: next(ms)))
    return ControlAPI(store=store, node="n1", region="sfo1", members=list, has_majority=lambda: majority,
                      digests=dict, token=BearerToken(token))


def _documented() -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in DOC["paths"].items() for method in METHODS if method in item}


def test_the_document_is_openapi_3_1_and_is_the_file() -> None:
    assert DOC["openapi"] == "3.1.0"
    path = Path(__file__).resolve().parents[2] / "region_agent" / "control" / "openapi.json"
    assert json.loads(path.read_text()) == DOC
    Draft202012Validator.check_schema({"$defs": DOC["components"]["schemas"]})


def test_every_route_is_documented_and_every_documented_route_exists(tmp_path: Path) -> None:
    app = web.Application()
    api = _api(tmp_path)
    api.install(app)
    served = {(route.method, route.resource.canonical) for route in app.router.routes()
              if route.resource is not None and route.method not in ("HEAD", "*")}
    assert any(route.method == "*" and route.resource is not None and route.resource.canonical == "/v1/{rest}"
               for route in app.router.routes())  # the fallback: our 404 and 405 under /v1/
    assert FALLBACK.startswith("/v1/{rest")
    assert served == _documented()
    assert {(route.method, route.template) for route in ROUTES} == _documented()
    assert {(route.method, route.path) for route in api.routes()} == _documented()
    operation_ids = [item[m]["operationId"] for item in DOC["paths"].values() for m in METHODS if m in item]
    assert len(operation_ids) == len(set(operation_ids))


def _schema_of(template: str, method: str, status: int) -> dict[str, Any] | None:
    responses = DOC["paths"][template][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {template} answers {status}, undocumented"
    response = responses[str(status)]
    if "$ref" in response:
        response = DOC["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    content = response.get("content")
    return None if content is None else content["application/json"]["schema"]


async def test_answers_follow_the_document(tmp_path: Path,
                                           aiohttp_client: Callable[[web.Application], Awaitable[Client]]) -> None:
    """A session of calls: every status is documented for its route and every body fits its schema."""
    app = web.Application()
    _api(tmp_path).install(app)
    client = await aiohttp_client(app)
    auth = {"Authorization": "Bearer t"}
    calls: list[tuple[str, str, str, object, dict[str, str]]] = [
        ("GET", "/v1/openapi.json", "/v1/openapi.json", None, {}),
        ("PUT", "/v1/regions/sfo1", "/v1/regions/{name}", {"ipv4": ["192.0.2.1"]}, auth),
        ("PUT", "/v1/regions/sfo1", "/v1/regions/{name}", {"ipv4": ["192.0.2.1"], "latitude": 1, "longitude": 2},
         auth),
        ("PUT", "/v1/regions/ams1", "/v1/regions/{name}", {"ipv4": ["nope"]}, auth),
        ("GET", "/v1/regions/sfo1", "/v1/regions/{name}", None, auth),
        ("GET", "/v1/regions/ams1", "/v1/regions/{name}", None, auth),
        ("GET", "/v1/regions", "/v1/regions", None, auth),
        ("PUT", "/v1/projects/shop", "/v1/projects/{slug}", {"regions": ["sfo1"]}, auth),
        ("PUT", "/v1/projects/shop", "/v1/projects/{slug}", {"regions": ["sfo1"], "mode": "proximity"}, auth),
        ("PUT", "/v1/projects/shop", "/v1/projects/{slug}", {"regions": ["sfo1"], "x": 1}, auth),
        ("PUT", "/v1/projects/shop", "/v1/projects/{slug}", {"regions": ["sfo1"]}, {}),
        ("GET", "/v1/projects/shop", "/v1/projects/{slug}", None, auth),
        ("GET", "/v1/projects", "/v1/projects", None, auth),
        ("DELETE", "/v1/regions/sfo1", "/v1/regions/{name}", None, auth),
        ("POST", "/v1/regions/sfo1/fence", "/v1/regions/{name}/fence", {"reason": "r"}, auth),
        ("POST", "/v1/regions/sfo1/unfence", "/v1/regions/{name}/unfence", None, auth),
        ("POST", "/v1/regions/lax1/fence", "/v1/regions/{name}/fence", None, auth),
        ("GET", "/v1/zone", "/v1/zone", None, auth),
        ("GET", "/v1/members", "/v1/members", None, auth),
        ("GET", "/v1/digests", "/v1/digests", None, auth),
        ("DELETE", "/v1/projects/shop", "/v1/projects/{slug}", None, auth),
        ("DELETE", "/v1/projects/shop", "/v1/projects/{slug}", None, auth),
    ]
    for method, path, template, body, headers in calls:
        async with client.request(method, path, json=body, headers=headers) as response:
            schema = _schema_of(template, method, response.status)
            text = await response.read()
            if schema is None:
                assert not text
                continue
            validator = Draft202012Validator({**schema, "components": DOC["components"]})
            validator.validate(json.loads(text))
    # Content types and size limits, once each.
    async with client.put("/v1/projects/shop", data=b"x", headers={**auth, "Content-Type": "text/plain"}) as response:
        assert _schema_of("/v1/projects/{slug}", "PUT", response.status) is not None
    async with client.put("/v1/projects/shop", data=b"{", headers={**auth, "Content-Type": "application/json"}) as r:
        assert r.status == 400 and _schema_of("/v1/projects/{slug}", "PUT", r.status) is not None


MakeClient = Callable[[web.Application], Awaitable[Client]]


async def test_the_minority_answer_is_documented(tmp_path: Path, aiohttp_client: MakeClient) -> None:
    app = web.Application()
    _api(tmp_path, majority=False).install(app)
    client = await aiohttp_client(app)
    async with client.put("/v1/regions/sfo1", json={}, headers={"Authorization": "Bearer t"}) as response:
        assert response.status == 503
        schema = _schema_of("/v1/regions/{name}", "PUT", 503)
        headers = DOC["components"]["responses"]["NoMajority"]["headers"]
        assert {"Retry-After", "X-Degraded", "X-Region", "X-Request-Id"} <= set(headers)
        assert all(name in response.headers for name in headers)
        assert schema is not None
        Draft202012Validator({**schema, "components": DOC["components"]}).validate(await response.json())
