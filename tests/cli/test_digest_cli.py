"""``zone --digest --all`` against a served /v1/digests: exit 0 converged, 3 differing, 4 with nobody to compare."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest

from region_agent.cli.inspect import cmd_digest
from tests.fakes.operator_listener import operator_listener

ME = {"region": "sfo1", "node": "n1", "digest": "aa" * 16}


@pytest.fixture
def served() -> Iterator[tuple[str, dict[str, Any]]]:
    answer: dict[str, Any] = {}
    with operator_listener({"/v1/digests": answer}) as (port, _asked):
        yield f"http://127.0.0.1:{port}", answer


def _run(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cmd_digest(argparse.Namespace(url=url, token_file=None, json=False, all=True))
    return code, capsys.readouterr().out


def test_an_isolated_agent_is_not_called_converged(served: tuple[str, dict[str, Any]],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    url, answer = served
    answer.update(ME, agents=[], converged=True)   # all() of no peers: what the API says of an island
    code, out = _run(url, capsys)
    assert code == 4 and "no live peer to compare with" in out and "# converged" not in out
    answer.update(agents=[{"member": "ams1/n2", "digest": "aa" * 16, "same": True}], converged=True)
    assert _run(url, capsys)[0] == 0
    answer.update(agents=[{"member": "ams1/n2", "digest": "bb" * 16, "same": False}], converged=False)
    code, out = _run(url, capsys)
    assert code == 3 and "DIFFERENT" in out
