"""The "three agents on one machine" recipe of docs/operating.md, run as written (bash, in a scratch
directory, ``region-agent`` from this checkout on the PATH): three agents join, the members command
lists them alive and every agent answers every region's copy; then one copy is taken down as the
recipe says, and it leaves the answers. Every process the recipe starts is stopped by its PID file."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for_sync

pytestmark = [pytest.mark.external, pytest.mark.skipif(shutil.which("dig") is None, reason="dig not installed")]

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- recipe: three-agents -->"


def recipe() -> str:
    text = (ROOT / "docs" / "operating.md").read_text()
    block = text.split(MARKER, 1)[1]
    match = re.match(r"\s*```sh\n(.*?)\n```", block, re.DOTALL)
    assert match, "the recipe's sh block follows its marker"
    return match.group(1)


def _dig(server: str) -> set[str]:
    out = subprocess.run(["dig", "+short", f"@{server}", "-p", "5300", "shop.g.example.com", "A"],
                         capture_output=True, text=True, timeout=10, check=False).stdout
    return set(out.split())


def _answers_are(server: str, expected: set[str]) -> bool:
    return _dig(server) == expected


def test_the_three_agent_recipe_runs_as_written(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "REGION_AGENT_SHUTDOWN_DRAIN_SECONDS": "0"}
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe()], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180, check=False)
        logs = "\n".join(f"{p.name}: {p.read_text()[-800:]}" for p in tmp_path.glob("*.log"))
        assert done.returncode == 0, done.stdout + done.stderr + logs
        members = [line for line in done.stdout.splitlines() if line.startswith(("sfo1/", "ams1/", "fra1/"))]
        assert len(members) == 3 and all(" alive " in f" {line} " for line in members), done.stdout
        assert set(done.stdout.splitlines()[-3:]) == {"127.0.0.41", "127.0.0.42", "127.0.0.43"}, done.stdout
        # "kill $(cat copy-ams1.pid)": ams1's copy leaves every answer
        os.kill(int((tmp_path / "copy-ams1.pid").read_text()), signal.SIGTERM)
        for server in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
            wait_for_sync(functools.partial(_answers_are, server, {"127.0.0.41", "127.0.0.43"}), timeout=20,
                          interval=0.2, message=f"ams1's copy out of {server}'s answers")
    finally:
        for pid_file in tmp_path.glob("*.pid"):   # what the recipe started, by PID
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
        for pid_file in tmp_path.glob("*.pid"):
            wait_for_sync(functools.partial(_gone, int(pid_file.read_text())), timeout=20, interval=0.1,
                          message=f"{pid_file.stem} stopped")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
