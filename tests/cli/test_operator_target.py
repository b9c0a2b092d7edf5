"""The inspection commands (``zone``, ``members``, ``geoip``, ``zone --digest``) find the operator listener and
its token in the agent's settings (``--config``); ``--url``/``--token-file`` win; an unusable token file is
reported as the file, not as the URL."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from region_agent.cli.main import main
from region_agent.cli.operator_client import DEFAULT_URL, operator_target, operator_url
from tests.fakes.operator_listener import operator_listener

TOKEN = "s3cret-operator-token"
ANSWERS = {
    "/v1/members": {"region": "sfo1", "majority": True, "regions": {"sfo1": "alive"},
                    "members": [{"name": "sfo1/n1", "address": "127.0.0.1:7946", "region": "sfo1", "role": "agent",
                                 "state": "alive", "since": 0, "rtt_ms": None, "meta": {}}]},
    "/zone": {"zone": "g.example.com", "serial": 7, "ready": True, "digest": "ab", "records": []},
    "/health/region": {"geoip": None, "reachable": None},
    "/v1/digests": {"region": "sfo1", "node": "n1", "digest": "ab", "agents": []},
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REGION_AGENT_CONFIG", "")   # --config sets it in this process
    for name in [n for n in os.environ if n.upper().startswith("REGION_AGENT_") and n != "REGION_AGENT_CONFIG"]:
        monkeypatch.delenv(name)


@pytest.fixture
def operator() -> Iterator[tuple[int, list[str]]]:
    """A stand-in operator listener on 127.0.0.1 that wants the bearer token; the paths asked."""
    with operator_listener(ANSWERS, TOKEN) as served:
        yield served


def agent_config(tmp_path: Path, port: int) -> str:
    token = tmp_path / "operator.token"
    token.write_text(TOKEN + "\n")
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"region": "sfo1", "health": {
        "operator_listen_addresses": ["127.0.0.1"], "operator_port": port, "operator_token_file": str(token)}}))
    return str(path)


def test_operator_url_from_the_listener_addresses() -> None:
    assert operator_url(("127.0.0.1",), 8087) == "http://127.0.0.1:8087"
    assert operator_url(("0.0.0.0",), 9000) == "http://127.0.0.1:9000"      # a wildcard: loopback
    assert operator_url(("::",), 8087) == "http://[::1]:8087"
    assert operator_url(("fd00::7", "10.0.0.1"), 8087) == "http://[fd00::7]:8087"
    assert operator_target(argparse.Namespace()) == (DEFAULT_URL, None)
    assert operator_target(argparse.Namespace(url="http://h:1/", token_file="t", config=None)) == ("http://h:1", "t")


@pytest.mark.parametrize("argv", [["members"], ["zone"], ["zone", "--json"], ["geoip"], ["zone", "--digest"]])
def test_config_gives_the_address_and_the_token(tmp_path: Path, operator: tuple[int, list[str]], argv: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    port, asked = operator
    assert main([*argv, "--config", agent_config(tmp_path, port)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert len(asked) == 1
    assert {"/v1/members": "sfo1/n1", "/zone": "g.example.com", "/health/region": "geoip:",
            "/v1/digests": "(this agent)"}[asked[0]] in out


def test_url_and_token_file_win_over_the_config(tmp_path: Path, operator: tuple[int, list[str]],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    port, asked = operator
    config = agent_config(tmp_path, 1)   # a port nothing listens on: --url must be the one used
    assert main(["members", "--config", config, "--url", f"http://127.0.0.1:{port}"]) == 0
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-it")
    assert main(["members", "--config", config, "--url", f"http://127.0.0.1:{port}", "--token-file", str(wrong)]) == 1
    assert "HTTP 401" in capsys.readouterr().err and len(asked) == 2


def test_a_missing_token_file_is_named_as_the_file(tmp_path: Path, operator: tuple[int, list[str]],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    port, asked = operator
    missing = tmp_path / "nowhere.token"
    for command in (["zone"], ["members"], ["geoip"], ["zone", "--digest"]):
        assert main([*command, "--url", f"http://127.0.0.1:{port}", "--token-file", str(missing)]) == 1
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"token file {missing}: No such file or directory"), err
        assert "http://" not in err and "\n" not in err
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    assert main(["members", "--url", f"http://127.0.0.1:{port}", "--token-file", str(empty)]) == 1
    assert capsys.readouterr().err.strip() == f"region-agent members: token file {empty}: empty"
    assert asked == []   # nothing was sent without a token


def test_a_config_whose_token_file_is_gone_stops_with_one_line(tmp_path: Path, operator: tuple[int, list[str]],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = agent_config(tmp_path, operator[0])
    (tmp_path / "operator.token").unlink()
    assert main(["members", "--config", config]) == 2
    err = capsys.readouterr().err.strip()
    assert "health.operator_token_file" in err and "operator.token" in err and "\n" not in err
