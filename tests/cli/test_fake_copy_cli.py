"""``region-agent fake-copy``: the fake copy helper as a subcommand, answering as told."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import wait_for_sync
from tests.fakes.ports import free_port


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_fake_copy_answers_as_told_and_follows_its_state_file(tmp_path: Path) -> None:
    port, state, log = free_port(), tmp_path / "copy.state", tmp_path / "copy.log"
    cli = Path(sys.executable).parent / "region-agent"
    process = subprocess.Popen([str(cli), "fake-copy", "--bind", "127.0.0.1", "--port", str(port), "--state", "down",
                                "--state-file", str(state), "--log", str(log)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(f"health endpoint on 127.0.0.1:{port} "), line
        url = f"http://127.0.0.1:{port}/global-health/shop"
        assert _status(url) == 503                      # --state down
        state.write_text("ok\n")
        assert _status(url) == 200                      # the state file wins
        wait_for_sync(lambda: log.exists() and len(log.read_text().splitlines()) == 2, message="two log lines")
        assert [entry.split()[2:4] for entry in log.read_text().splitlines()] == [
            ["/global-health/shop", "503"], ["/global-health/shop", "200"]]
    finally:
        process.terminate()
        process.wait(timeout=10)
