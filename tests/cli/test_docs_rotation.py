"""The key-rotation script of docs/operating.md, run as written (``push`` to the regions stubbed out)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from region_agent.cli.main import main
from region_agent.gossip.keyfile import load_keyring

ROOT = Path(__file__).resolve().parents[2]


def rotation_script() -> str:
    text = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")
    section = text.split("### Rotate the gossip key", 1)[1]
    script = re.search(r"```sh\n(.*?)```", section, re.S)
    assert script is not None, "no sh block under 'Rotate the gossip key'"
    return script.group(1)


def test_the_rotation_script_runs_as_written(tmp_path: Path) -> None:
    script = rotation_script()
    # Every variable it uses is set by the script itself (the doc once used $OLD without setting it).
    assert "OLD=" in script and "NEW=" in script
    body = re.sub(r"^push\(\) \{.*?^\}\n", "", script, flags=re.S | re.M)
    assert body != script, "the push() function was not found"
    assert main(["keys", "init", "--dir", str(tmp_path / "cluster-keys")]) == 0
    before = load_keyring(tmp_path / "cluster-keys" / "keyring.json").primary
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    pushes = tmp_path / "pushes"
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", f"push() {{ echo >> {pushes}; }}\n{body}"],
                            check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    after = load_keyring(tmp_path / "k.json")
    assert after.keys() == [after.primary] and after.primary != before   # OLD removed, NEW in use
    assert pushes.read_text().count("\n") == 3                            # one push per step
