"""Start-up errors are one line naming the setting and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from region_agent.cli.main import main


@pytest.fixture(autouse=True)
def _restore_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--config`` sets REGION_AGENT_CONFIG in the process; later tests must not read that file."""
    monkeypatch.setenv("REGION_AGENT_CONFIG", "")  # recorded, so the value main() sets is undone


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_a_settings_file_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "agent.yaml"
    config.write_bytes(b"region: sfo1\nnode: \"\xff\"\n")
    assert "not UTF-8" in _one_line_error(capsys, ["check-config", "--config", str(config)])


def test_a_list_variable_that_is_not_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REGION_AGENT_DNS__LISTEN_ADDRESSES", "127.0.0.75")
    err = _one_line_error(capsys, ["check-config"])
    assert "REGION_AGENT_DNS__LISTEN_ADDRESSES='127.0.0.75'" in err
    assert "JSON" in err
