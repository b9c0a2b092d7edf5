"""Names that become DNS names are refused at the control API when they can not be one (RFC 1035 §2.3.4).

Before: a region of 61+ characters was accepted (201), and every later zone compilation raised
(``ns-<region>.<zone>`` is not a DNS name), so nothing else the cluster wrote was ever answered.
"""

from __future__ import annotations

import json
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient

from region_agent.base.bearer import BearerToken
from region_agent.control import ControlAPI
from region_agent.globaldns.compiler import ZoneConfig, compile_zone
from region_agent.state.hlc import HybridClock
from region_agent.state.store import Store
from tests.control.test_api import AUTH, TOKEN, MakeClient

Client = TestClient[web.Request, web.Application]
CONFIG = ZoneConfig("g.example.com")
LONG_REGION = "abc" + "1" * 58   # 61 characters: ns-<region> is a 64-octet label


async def _client(aiohttp_client: MakeClient, tmp_path: Path) -> tuple[Client, Store]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    ms = iter(range(1_800_000_000_000, 1_900_000_000_000, 1000))
    store = Store(writer="sfo1/n1", clock=HybridClock(lambda: next(ms)))
    app = web.Application()
    ControlAPI(store=store, node="n1", region="sfo1", members=list, has_majority=lambda: True,
               digests=dict, token=BearerToken(token)).install(app)
    return await aiohttp_client(app), store


async def _put(client: Client, path: str, body: object) -> tuple[int, dict[str, object]]:
    async with client.put(path, data=json.dumps(body), headers={**AUTH, "Content-Type": "application/json"}) as r:
        return r.status, await r.json()


async def test_a_region_too_long_for_its_name_server_name_is_refused_and_the_zone_still_compiles(
        aiohttp_client: MakeClient, tmp_path: Path) -> None:
    client, store = await _client(aiohttp_client, tmp_path)
    status, body = await _put(client, f"/v1/regions/{LONG_REGION}", {"ipv4": ["192.0.2.1"], "ns_ipv4": ["192.0.2.53"]})
    assert (status, body["field"]) == (422, "path.name"), body
    assert "60" in str(body["error"])
    assert len(store) == 0
    assert await _put(client, "/v1/regions/sfo1", {"ipv4": ["192.0.2.1"], "ns_ipv4": ["192.0.2.53"]}) == (201, {
        "name": "sfo1", "ipv4": ["192.0.2.1"], "ipv6": [], "ns_ipv4": ["192.0.2.53"], "ns_ipv6": [],
        "latitude": None, "longitude": None, "witness": False})
    assert (await _put(client, "/v1/projects/shop", {"regions": ["sfo1"]}))[0] == 201
    assert "shop" in compile_zone(store.snapshot(), CONFIG).projects


async def test_the_longest_region_name_is_accepted_and_compiled(aiohttp_client: MakeClient, tmp_path: Path) -> None:
    client, store = await _client(aiohttp_client, tmp_path)
    longest = LONG_REGION[:-1]
    assert (await _put(client, f"/v1/regions/{longest}", {"ns_ipv4": ["192.0.2.53"]}))[0] == 201
    tables = compile_zone(store.snapshot(), CONFIG)
    assert any(d.get("name") == f"ns-{longest}.g.example.com" for d in tables.description)
