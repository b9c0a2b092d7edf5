"""TSIG keys from a mounted file rotate without a restart (dns.acme.tsig_keys_file, re-read when it changes).

A running agent on loopback ports; UPDATEs go over UDP as cert-manager sends them, as exact bytes
whose answers are read without checking their TSIG (the outcome is in the TSIG's error field).
The file is replaced the way a Kubernetes Secret volume does it (a new file renamed over the old one).
"""

from __future__ import annotations

import base64
import os
from collections.abc import AsyncIterator
from pathlib import Path

import dns.message
import dns.rcode
import dns.tsig
import pytest

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from tests.conftest import wait_for
from tests.fakes.dns_client import TsigKey, ask, signed, txt_update

ZONE = "g.example.com"
CHALLENGE = f"_acme-challenge.{ZONE}."
OLD = base64.b64encode(b"the-old-key-0123456789abcdef0123").decode()
NEW = base64.b64encode(b"the-new-key-0123456789abcdef0123").decode()
ZONE_FILE = ("regions: {sfo1: {ipv4: [127.0.0.51], ns_ipv4: [127.0.0.53]}}\n"
             "projects: {shop: {regions: [sfo1]}}\n")


def _keys(**keys: str) -> str:
    return "".join(f"{name}: {{algorithm: hmac-sha256, secret: {secret}}}\n" for name, secret in keys.items())


def _replace(path: Path, text: str) -> None:
    """Write beside and rename over, as the kubelet swaps a Secret's files."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE_FILE)
    keys = tmp_path / "tsig-keys.yaml"
    keys.write_text(_keys(old=OLD))
    running = Agent(AgentSettings(
        region="sfo1", zone_file=zone,
        dns={"zone": ZONE, "listen_addresses": ["127.0.0.1"], "port": 0, "acme": {"tsig_keys_file": keys}},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    assert running.dns.tsig_keys is not None
    running.dns.tsig_keys.poll = 0.02  # the test waits on the outcome, not on the poll period
    await running.start()
    try:
        await wait_for(running.ready.is_set, timeout=10, message="ready")
        yield running
    finally:
        await running.stop()


def _update(name: str, secret: str, value: str) -> bytes:
    """cert-manager's Present: add the TXT with TTL 60, signed."""
    return signed(txt_update(ZONE, CHALLENGE, "add", value), TsigKey(name, secret, dns.tsig.HMAC_SHA256)).to_wire()


TSIG_ERRORS = {0: "NOERROR", 16: "BADSIG", 17: "BADKEY", 18: "BADTIME"}  # 16 is BADVERS as an rcode


def _outcome(response: dns.message.Message) -> tuple[str, str | None]:
    error = None if response.tsig is None else TSIG_ERRORS[response.tsig[0].error]
    return dns.rcode.to_text(response.rcode()), error


def _problems(agent: Agent) -> list[str]:
    return [p for p in agent.problems() if "TSIG keys file" in p]


async def test_a_new_key_is_accepted_without_a_restart_and_a_removed_one_refused(agent: Agent,
                                                                               tmp_path: Path) -> None:
    keys = tmp_path / "tsig-keys.yaml"
    port = agent.dns.server.bound[0][1]
    with_new = _update("new", NEW, "by-new")
    digest = agent.store.digest()
    assert _outcome(await ask(port, with_new)) == ("NOTAUTH", "BADKEY")
    assert agent.store.digest() == digest  # refused: nothing changed

    _replace(keys, _keys(old=OLD, new=NEW))  # install: both keys verify
    assert agent.dns.tsig_keys is not None
    await wait_for(lambda: len(agent.dns.acme.config.keyring) == 2 if agent.dns.acme else False,
                   message="the new key in use")
    assert _outcome(await ask(port, with_new)) == ("NOERROR", "NOERROR")  # the same UPDATE, signed back
    assert set(agent.store.challenges.get(CHALLENGE, {})) != set()
    assert _outcome(await ask(port, _update("old", OLD, "by-old"))) == ("NOERROR", "NOERROR")
    assert agent.registry.get_sample_value("region_agent_dns_tsig_keys") == 2
    assert agent.registry.get_sample_value("region_agent_dns_tsig_keys_file_reloads_total") == 1

    _replace(keys, _keys(new=NEW))  # remove the old key
    await wait_for(lambda: agent.registry.get_sample_value("region_agent_dns_tsig_keys") == 1,
                   message="the old key removed")
    assert _outcome(await ask(port, _update("old", OLD, "old-again"))) == ("NOTAUTH", "BADKEY")
    assert _outcome(await ask(port, _update("new", NEW, "new-again"))) == ("NOERROR", "NOERROR")
    assert _problems(agent) == []


async def test_a_corrupt_file_keeps_the_current_keys_and_shows_as_a_problem(agent: Agent, tmp_path: Path) -> None:
    keys = tmp_path / "tsig-keys.yaml"
    port = agent.dns.server.bound[0][1]
    errors = "region_agent_dns_tsig_keys_file_errors_total"
    for broken in ("old: {algorithm: hmac-sha256, secret: [unclosed\n",  # not YAML
                   _keys(old="not base64!"),  # a key that can not be used
                   "- a list\n"):  # not a mapping of keys
        before = agent.registry.get_sample_value(errors) or 0
        _replace(keys, broken)
        await wait_for(lambda: (agent.registry.get_sample_value(errors) or 0) > before,  # noqa: B023
                       message="the bad file counted")
        problems = _problems(agent)
        assert len(problems) == 1 and str(keys) in problems[0], problems
        assert _outcome(await ask(port, _update("old", OLD, "still"))) == ("NOERROR", "NOERROR")
        view = agent.region_view()
        assert view.degraded and any("TSIG keys file" in p for p in view.degraded)

    keys.unlink()  # a missing file is no different: the keys stay
    await wait_for(lambda: "No such file" in " ".join(_problems(agent)), message="the missing file shown")
    assert _outcome(await ask(port, _update("old", OLD, "missing"))) == ("NOERROR", "NOERROR")

    _replace(keys, _keys(old=OLD))  # fixed: no problem, nothing else changed
    await wait_for(lambda: not _problems(agent), message="the problem cleared")
    assert agent.registry.get_sample_value("region_agent_dns_tsig_keys") == 1
    assert agent.registry.get_sample_value("region_agent_dns_tsig_keys_file_reloads_total") == 0


async def test_a_keys_file_that_starts_empty_turns_update_on(tmp_path: Path) -> None:
    """With a file set UPDATE is on from the start (no key: BADKEY), so the first key needs no restart."""
    keys = tmp_path / "tsig-keys.yaml"
    keys.write_text("")
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE_FILE)
    agent = Agent(AgentSettings(
        region="sfo1", zone_file=zone,
        dns={"zone": ZONE, "listen_addresses": ["127.0.0.1"], "port": 0, "acme": {"tsig_keys_file": keys}},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    assert agent.dns.tsig_keys is not None
    agent.dns.tsig_keys.poll = 0.02
    await agent.start()
    try:
        port = agent.dns.server.bound[0][1]
        first = _update("new", NEW, "first")
        assert _outcome(await ask(port, first)) == ("NOTAUTH", "BADKEY")
        _replace(keys, _keys(new=NEW))
        await wait_for(lambda: agent.registry.get_sample_value("region_agent_dns_tsig_keys") == 1,
                       message="the first key in use")
        assert _outcome(await ask(port, first)) == ("NOERROR", "NOERROR")
    finally:
        await agent.stop()


async def test_a_new_secret_under_the_same_name_replaces_the_old(agent: Agent, tmp_path: Path) -> None:
    port = agent.dns.server.bound[0][1]
    before = _update("old", OLD, "before")
    _replace(tmp_path / "tsig-keys.yaml", _keys(old=NEW))
    await wait_for(lambda: agent.registry.get_sample_value("region_agent_dns_tsig_keys_file_reloads_total") == 1,
                   message="the new secret in use")
    assert _outcome(await ask(port, before)) == ("NOTAUTH", "BADSIG")
    assert _outcome(await ask(port, _update("old", NEW, "after"))) == ("NOERROR", "NOERROR")
