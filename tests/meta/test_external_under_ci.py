"""Under CI a test marked ``external`` that cannot run fails the run instead of skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = '''
import pytest

@pytest.mark.external
@pytest.mark.skipif(True, reason="the program is not installed")
def test_needs_a_program() -> None:
    pass
'''


def _run(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    probe = tmp_path / "test_probe_external.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    # The project's settings and its conftest as a plugin, on a test file outside the tree.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"),
                           "--rootdir", str(ROOT), "-p", "tests.conftest", str(probe)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def test_skip_fails_under_ci(tmp_path: Path) -> None:
    done = _run(tmp_path, ci=True)
    assert done.returncode == 1, done.stdout
    assert "external test skipped under CI" in done.stdout


def test_skip_is_a_skip_elsewhere(tmp_path: Path) -> None:
    done = _run(tmp_path, ci=False)
    assert done.returncode == 0, done.stdout
    assert "1 skipped" in done.stdout
