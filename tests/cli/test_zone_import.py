"""``region-agent zone import`` against the control API on a real aiohttp server backed by a real Store.

The importer is the CLI's own code path (``region_agent.cli.main.main``), run in a thread so the server keeps
answering on the test's loop; its writes go through ControlAPI exactly as the control plane's do.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Awaitable, Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from region_agent.base.bearer import BearerToken
from region_agent.cli.main import main
from region_agent.cli.zone_import import idempotency_key, run_import
from region_agent.control import ControlAPI
from region_agent.state.hlc import HybridClock
from region_agent.state.model import Project
from region_agent.state.store import Store

TOKEN = "import-token"
CONTROL = "control/someone-else"

ZONE = """\
regions:
  sfo1: {ipv4: [192.0.2.1], ns_ipv4: [192.0.2.53], latitude: 37.6, longitude: -122.4}
  ams1: {ipv4: [198.51.100.1]}
projects:
  shop: {regions: [sfo1, ams1], primary: sfo1}
  blog: {regions: [ams1], mode: proximity}
  docs: {regions: [sfo1, ams1], all_down: primary}
  wiki: {regions: [sfo1]}
"""


Importer = Callable[..., Awaitable[tuple[int, str, str]]]


@dataclass
class Agent:
    """The API's collaborators: a real Store, a controllable majority, and what the API was asked."""

    store: Store
    majority: Callable[[], bool] = lambda: True
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, idempotency key
    url: str = ""


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
async def agent(aiohttp_server: Callable[[web.Application], Awaitable[TestServer]], token_file: Path) -> Agent:
    ms = iter(range(1_800_000_000_000, 1_900_000_000_000, 1000))
    state = Agent(Store(writer="sfo1/n1", clock=HybridClock(lambda: next(ms))))

    def has_majority() -> bool:  # state.majority is swapped by tests
        return state.majority()

    api = ControlAPI(store=state.store, node="n1", region="sfo1", members=list, has_majority=has_majority,
                     digests=dict, token=BearerToken(token_file), retry_after_seconds=2)

    @web.middleware
    async def record(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        state.requests.append((request.method, request.path, request.headers.get("Idempotency-Key")))
        return await handler(request)

    app = web.Application(middlewares=[record])
    api.install(app)
    server = await aiohttp_server(app)
    state.url = str(server.make_url("/"))
    return state


async def _cli(*argv: str) -> tuple[int, str, str]:
    """``region-agent <argv>`` in a thread: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with redirect_stdout(out), redirect_stderr(err):
            return main(list(argv))

    code = await asyncio.to_thread(run)
    return code, out.getvalue(), err.getvalue()


def _zone(tmp_path: Path, text: str, name: str = "zone.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _writes(agent: Agent) -> list[tuple[str, str, str | None]]:
    return [r for r in agent.requests if r[0] != "GET"]


@pytest.fixture
def imported(agent: Agent, tmp_path: Path, token_file: Path) -> Iterator[Importer]:
    def call(*extra: str, zone: Path | None = None) -> Awaitable[tuple[int, str, str]]:
        path = zone or _zone(tmp_path, ZONE)
        return _cli("zone", "import", str(path), "--url", agent.url, "--token-file", str(token_file), *extra)

    yield call


async def test_first_import_writes_regions_then_projects_with_deterministic_keys(
        agent: Agent, imported: Importer) -> None:
    EMPTY_DIGEST = agent.store.digest()  # noqa: N806
    code, out, err = await imported()
    assert code == 0, err
    writes = _writes(agent)
    assert [(m, p) for m, p, _ in writes] == [
        ("PUT", "/v1/regions/ams1"), ("PUT", "/v1/regions/sfo1"),
        ("PUT", "/v1/projects/blog"), ("PUT", "/v1/projects/docs"), ("PUT", "/v1/projects/shop"),
        ("PUT", "/v1/projects/wiki")]
    store = agent.store
    assert set(store.regions) == {"sfo1", "ams1"} and set(store.projects) == {"shop", "blog", "docs", "wiki"}
    assert store.regions["sfo1"].latitude == 37.6 and store.projects["shop"].primary == "sfo1"
    assert store.projects["blog"].mode.value == "proximity" and store.projects["docs"].all_down.value == "primary"
    # the key is a hash of method, path, body and the store digest read before planning (empty store)
    body = json.dumps(store.projects["shop"].to_dict(), sort_keys=True, separators=(",", ":")).encode()
    assert writes[4][2] == idempotency_key("PUT", "/v1/projects/shop", body, EMPTY_DIGEST)
    assert len({key for _, _, key in writes}) == len(writes)
    lines = out.splitlines()
    assert "+ region sfo1: created" in lines and "+ project shop: created" in lines
    assert lines[-1] == ("regions: 2 created, 0 changed, 0 unchanged; projects: 4 created, 0 changed, 0 deleted, "
                         "0 unchanged")


async def test_reimport_changes_nothing(agent: Agent, imported: Importer
                                        ) -> None:
    assert (await imported())[0] == 0
    digest = agent.store.digest()
    agent.requests.clear()
    code, out, _ = await imported()
    assert code == 0
    assert _writes(agent) == [] and agent.store.digest() == digest
    assert out.splitlines() == ["regions: 0 created, 0 changed, 2 unchanged; projects: 0 created, 0 changed, "
                                "0 deleted, 4 unchanged"]


async def test_a_changed_project_is_the_only_write_and_dry_run_writes_nothing(
        agent: Agent, imported: Importer, tmp_path: Path) -> None:
    assert (await imported())[0] == 0
    changed = _zone(tmp_path, ZONE.replace("shop: {regions: [sfo1, ams1], primary: sfo1}",
                                           "shop: {regions: [sfo1, ams1], primary: ams1}"), "changed.yaml")
    agent.requests.clear()
    code, out, _ = await imported("--dry-run", zone=changed)
    assert code == 0 and _writes(agent) == []
    assert out.splitlines()[0] == "~ project shop: would change (primary)"
    assert agent.store.projects["shop"].primary == "sfo1"

    code, out, _ = await imported(zone=changed)
    assert code == 0
    assert [(m, p) for m, p, _ in _writes(agent)] == [("PUT", "/v1/projects/shop")]
    assert agent.store.projects["shop"].primary == "ams1"
    assert out.splitlines()[0] == "~ project shop: changed (primary)"
    assert "projects: 0 created, 1 changed, 0 deleted, 3 unchanged" in out

    # Changed back by someone else, then the same import again: the same PUT as before, but a new
    # key (the store digest differs), so the agent writes instead of replaying the earlier answer.
    first_key = _writes(agent)[-1][2]
    agent.store.put_many([(("project", "shop"), Project("shop", ("sfo1", "ams1"), "sfo1"))], writer=CONTROL)
    agent.requests.clear()
    code, out, _ = await imported(zone=changed)
    assert code == 0 and agent.store.projects["shop"].primary == "ams1"
    assert _writes(agent)[0][2] != first_key and "replayed" not in out


async def test_prune_deletes_what_the_file_dropped_but_refuses_more_than_half(
        agent: Agent, imported: Importer, tmp_path: Path) -> None:
    assert (await imported())[0] == 0
    one_left = _zone(tmp_path, ZONE.split("  blog:", maxsplit=1)[0], "one.yaml")  # only shop: 3 of 4 would go
    agent.requests.clear()
    code, out, err = await imported("--prune", zone=one_left)
    assert code == 2 and _writes(agent) == []
    assert "would delete 3 of the agent's 4 projects" in err and "--force" in err
    assert set(agent.store.projects) == {"shop", "blog", "docs", "wiki"}

    # without --prune nothing is deleted, and the summary says so
    code, out, _ = await imported(zone=one_left)
    assert code == 0 and _writes(agent) == [] and "3 project(s) not in the file kept" in out

    half = _zone(tmp_path, ZONE.replace("  wiki: {regions: [sfo1]}\n", "").replace(
        "  docs: {regions: [sfo1, ams1], all_down: primary}\n", ""), "half.yaml")
    code, out, _ = await imported("--prune", zone=half)  # 2 of 4 is not more than half
    assert code == 0, out
    assert [(m, p) for m, p, _ in _writes(agent)] == [("DELETE", "/v1/projects/docs"), ("DELETE", "/v1/projects/wiki")]
    assert "- project docs: deleted" in out and set(agent.store.projects) == {"shop", "blog"}

    code, out, _ = await imported("--prune", "--force", zone=one_left)
    assert code == 0 and set(agent.store.projects) == {"shop"}


async def test_a_422_stops_the_import_and_names_the_field(
        agent: Agent, imported: Importer, tmp_path: Path) -> None:
    # The file's parser bounds nothing the API bounds (64 addresses a list): a valid file, a 422.
    many = ", ".join(f"192.0.2.{i}" for i in range(1, 66))
    zone = _zone(tmp_path, ZONE.replace("sfo1: {ipv4: [192.0.2.1],", f"sfo1: {{ipv4: [{many}],"), "many.yaml")
    code, out, err = await imported(zone=zone)
    assert code == 1
    assert "PUT /v1/regions/sfo1: 422 $.ipv4: ipv4 may hold at most 64 addresses" in err
    assert "stopped" in err
    # ams1 (first) was written; nothing after the refusal was sent
    assert [(m, p) for m, p, _ in _writes(agent)] == [("PUT", "/v1/regions/ams1"), ("PUT", "/v1/regions/sfo1")]
    assert out.splitlines() == ["+ region ams1: created"]
    assert set(agent.store.regions) == {"ams1"} and not agent.store.projects


async def test_an_unknown_region_422_names_the_field_and_stops(
        agent: Agent, imported: Importer, tmp_path: Path) -> None:
    assert (await imported())[0] == 0
    # Between the importer's read and its writes, a region disappears at the agent: the project
    # PUT naming it gets 422 naming $.regions[1]; the import stops there (wiki is not written).
    text = ZONE.replace("  wiki: {regions: [sfo1]}", "  wiki: {regions: [sfo1], mode: proximity}").replace(
        "  blog: {regions: [ams1], mode: proximity}", "  blog: {regions: [sfo1, ams1]}")
    zone = _zone(tmp_path, text, "moved.yaml")
    gets = 0
    original_majority = agent.majority

    def drop_ams1_after_reading() -> bool:  # the write gate runs before each write: the 1st write drops ams1
        nonlocal gets
        gets += 1
        if gets == 1:
            agent.store.put_many([(("project", "blog"), None), (("project", "shop"), None),
                                  (("project", "docs"), None), (("region", "ams1"), None)], writer=CONTROL)
        return original_majority()

    agent.majority = drop_ams1_after_reading
    agent.requests.clear()
    code, _out, err = await imported(zone=zone)
    assert code == 1
    assert "PUT /v1/projects/blog: 422 $.regions[1]: region ams1 is not a known region" in err
    assert [(m, p) for m, p, _ in _writes(agent)] == [("PUT", "/v1/projects/blog")]
    assert agent.store.projects["wiki"].mode.value == "ha"  # not reached


async def test_a_503_is_retried_after_retry_after_then_succeeds(agent: Agent, tmp_path: Path, token_file: Path
                                                               ) -> None:
    answers = iter([False, False])
    agent.majority = lambda: next(answers, True)  # the first two writes find no majority
    waits: list[float] = []
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(run_import, _zone(tmp_path, ZONE), agent.url, token_file, out=out, err=err,
                                   sleep=waits.append)
    assert code == 0, err.getvalue()
    assert waits == [2.0, 2.0]  # the API's Retry-After, honoured
    writes = _writes(agent)
    assert [p for _, p, _ in writes[:3]] == ["/v1/regions/ams1"] * 3
    assert len({key for _, p, key in writes if p == "/v1/regions/ams1"}) == 1  # the same key every time
    assert set(agent.store.projects) == {"shop", "blog", "docs", "wiki"}

    # A bounded number of retries: a minority that lasts ends the import with exit 1.
    agent.majority = lambda: False
    waits.clear()
    changed = _zone(tmp_path, ZONE.replace("primary: sfo1", "primary: ams1"), "changed.yaml")
    code = await asyncio.to_thread(run_import, changed, agent.url, token_file, out=out, err=err, sleep=waits.append,
                                   retries=2)
    assert code == 1 and waits == [2.0, 2.0]
    assert "503" in err.getvalue() and "still 503 after 3 attempts" in err.getvalue()


async def test_a_retried_write_is_replayed_not_repeated(agent: Agent, tmp_path: Path, token_file: Path) -> None:
    """The same key and body after a lost answer: the agent replays its first answer."""
    assert await asyncio.to_thread(run_import, _zone(tmp_path, ZONE), agent.url, token_file,
                                   out=io.StringIO(), err=io.StringIO()) == 0
    shop_put = next(r for r in _writes(agent) if r[1] == "/v1/projects/shop")
    import urllib.request

    body = json.dumps(agent.store.projects["shop"].to_dict(), sort_keys=True, separators=(",", ":")).encode()
    request = urllib.request.Request(agent.url.rstrip("/") + "/v1/projects/shop", data=body, method="PUT", headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", "Idempotency-Key": str(shop_put[2])})
    response = await asyncio.to_thread(urllib.request.urlopen, request, timeout=5)
    assert response.status == 201 and response.headers["Idempotent-Replayed"] == "true"


async def test_bad_file_bad_arguments_and_transport_failure(tmp_path: Path, token_file: Path) -> None:
    bad = _zone(tmp_path, "regions: {}\nprojects: {}\n", "bad.yaml")
    code, _, err = await _cli("zone", "import", str(bad), "--token-file", str(token_file))
    assert code == 2 and "no regions" in err
    code, _, err = await _cli("zone", "import", str(_zone(tmp_path, ZONE)))
    assert code == 2 and "--token-file is required" in err
    code, _, err = await _cli("zone", "import", str(_zone(tmp_path, ZONE)), "--token-file", str(tmp_path / "none"))
    assert code == 2 and "--token-file" in err
    code, _, err = await _cli("zone", "import", str(_zone(tmp_path, ZONE)), "--token-file", str(token_file),
                              "--url", "ftp://x")
    assert code == 2 and "not an http" in err
    # nothing listens there: connection refused, retried a bounded number of times, then exit 1
    from tests.fakes.ports import free_port

    code, _, err = await _cli("zone", "import", str(_zone(tmp_path, ZONE)), "--token-file", str(token_file),
                              "--url", f"http://127.0.0.1:{free_port()}", "--retries", "1", "--max-wait", "0")
    assert code == 1 and "gave up after 2 attempts" in err


async def test_a_wrong_token_is_an_api_failure(agent: Agent, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    code, _, err = await _cli("zone", "import", str(_zone(tmp_path, ZONE)), "--url", agent.url, "--token-file",
                              str(wrong))
    assert code == 1 and "GET /v1/digests: 401 header.Authorization" in err
    assert len(agent.store) == 0
