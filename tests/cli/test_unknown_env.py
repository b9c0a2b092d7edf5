"""A ``REGION_AGENT_*`` variable that is no setting is named in one warning at start (``run``, ``check-config``):
pydantic-settings ignores it silently, so a typo would otherwise pass unnoticed."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from region_agent.app.settings import NON_SETTINGS_ENV, settings_env_names, unknown_env_variables
from region_agent.cli import main as cli_main
from region_agent.cli.main import main
from tests.fakes.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TYPOS = {"REGION_AGENT_DNS__PROT", "REGION_AGENT_GOSIP__SEEDS", "REGION_AGENT_WHATEVER", "REGION_AGENT_LOGLEVEL",
         "REGION_AGENT_DNS__PORT__X"}   # the typos of these tests and of the cli README's example


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REGION_AGENT_CONFIG", "")
    for name in [n for n in os.environ if n.upper().startswith("REGION_AGENT_") and n != "REGION_AGENT_CONFIG"]:
        monkeypatch.delenv(name)


@pytest.fixture
def root_handlers() -> Iterator[None]:
    """``run`` installs its JSON handler on the root logger: put the test's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)



def config_file(tmp_path: Path) -> str:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({
        "region": "sfo1", "node": "n1",
        "dns": {"zone": "g.example.com", "listen_addresses": ["127.0.0.1"], "port": free_port()},
        "health": {"listen_addresses": ["127.0.0.1"], "port": free_port(), "operator_port": free_port()}}))
    return str(path)


def test_unknown_variables_are_named_with_the_closest_setting() -> None:
    environ = {
        "REGION_AGENT_DNS__PROT": "5353",            # a typo of a nested field
        "REGION_AGENT_GOSIP__SEEDS": "[]",           # a typo of a group
        "REGION_AGENT_DNS__PORT__X": "1",            # below a field that is no group
        "REGION_AGENT_WHATEVER": "1",                # nothing near it
        "REGION_AGENT_DNS__PORT": "5353",            # real settings, at every depth and in any case
        "REGION_AGENT_DNS": "{}",
        "REGION_AGENT_DNS__ACME__TSIG_KEYS_FILE": "/k",
        "region_agent_log_level": "debug",
        "REGION_AGENT_CONFIG": "agent.yaml",         # the project's variables that are no settings
        "REGION_AGENT_RECORD": "1",
        "OTHER_DNS__PROT": "1",                      # not ours
    }
    assert unknown_env_variables(environ) == [
        "environment variable REGION_AGENT_DNS__PORT__X is not a setting, ignored; "
        "did you mean REGION_AGENT_DNS__PORT?",
        "environment variable REGION_AGENT_DNS__PROT is not a setting, ignored; did you mean REGION_AGENT_DNS__PORT?",
        "environment variable REGION_AGENT_GOSIP__SEEDS is not a setting, ignored; "
        "did you mean REGION_AGENT_GOSSIP__SEEDS?",
        "environment variable REGION_AGENT_WHATEVER is not a setting, ignored",
    ]


def test_every_region_agent_variable_the_project_names_is_known() -> None:
    """The chart, the docs, the scripts and the tests set no variable the agent would warn about."""
    known = set(settings_env_names()) | NON_SETTINGS_ENV
    named: dict[str, str] = {}
    for path in [*ROOT.glob("*.md"), *ROOT.glob("docs/**/*"), *ROOT.glob("helm/**/*"), *ROOT.glob("scripts/**/*"),
                 *ROOT.glob("container/**/*"), *ROOT.glob("region_agent/**/*"), *ROOT.glob("tests/**/*.py"),
                 *ROOT.glob("bench/**/*.py")]:
        if not path.is_file() or path.suffix not in {".md", ".py", ".sh", ".yaml", ".tpl", ".txt", ""}:
            continue
        for name in re.findall(r"REGION_AGENT_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8", errors="replace")):
            named.setdefault(name, str(path.relative_to(ROOT)))
    named.pop("REGION_AGENT_", None)
    # names written as a prefix of others (``REGION_AGENT_KUBE__WATCH__...``) end in ``__``: not matched above
    assert "REGION_AGENT_GOSSIP__SEEDS_DNS" in named and "REGION_AGENT_RECORD" in named   # the scan works
    unknown = {name: where for name, where in named.items() if name not in known and name not in TYPOS}
    assert unknown == {}


def test_check_config_warns_once_per_unknown_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REGION_AGENT_LOGLEVEL", "debug")
    monkeypatch.setenv("REGION_AGENT_HEALTH__PORT", str(free_port()))   # a real one: no warning
    assert main(["check-config", "--config", config_file(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == ["region-agent: warning: environment variable REGION_AGENT_LOGLEVEL is not a "
                                "setting, ignored; did you mean REGION_AGENT_LOG_LEVEL?"]
    monkeypatch.delenv("REGION_AGENT_LOGLEVEL")
    assert main(["check-config", "--config", config_file(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


def test_run_logs_the_warning_before_the_agent_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], root_handlers: None) -> None:
    started: list[str] = []

    def start(coro: Coroutine[Any, Any, int]) -> int:   # the agent itself is not needed here
        coro.close()
        started.append(capsys.readouterr().err)
        return 0

    monkeypatch.setattr(cli_main, "_run", start)
    monkeypatch.setenv("REGION_AGENT_GOSIP__SEEDS", "[]")
    assert main(["run", "--config", config_file(tmp_path)]) == 0
    assert len(started) == 1
    records = [json.loads(line) for line in started[0].splitlines()]
    assert [(r["level"], r["msg"]) for r in records] == [
        ("warning", "environment variable REGION_AGENT_GOSIP__SEEDS is not a setting, ignored; "
                    "did you mean REGION_AGENT_GOSSIP__SEEDS?")]


def test_a_typo_inside_a_group_is_refused_naming_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Inside a group the settings forbid unknown fields: exit 2, the line names the variable and the fix."""
    monkeypatch.setenv("REGION_AGENT_DNS__PROT", "5353")
    assert main(["check-config", "--config", config_file(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "region-agent: invalid settings: dns.prot: Extra inputs are not permitted (from REGION_AGENT_DNS__PROT; "
        "did you mean REGION_AGENT_DNS__PORT?)"]
