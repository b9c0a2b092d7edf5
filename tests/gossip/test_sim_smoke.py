"""The simulator bench runs end to end (``--smoke``: tiny N, a few seconds) and writes every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gossip_sim_smoke(tmp_path: Path) -> None:
    out = tmp_path / "sim.jsonl"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gossip_sim.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["type"] == "run" and lines[-1]["type"] == "end"
    sizes = [line for line in lines if line.get("name") == "size"]
    assert [s["n"] for s in sizes] == [5, 20]
    for size in sizes:
        assert size["broadcast_all_s"]["missing"] == 0
        assert size["dead_all_s"]["missing"] == 0
        assert size["false_failures"] == 0
        assert size["load"]["packets_per_agent_s"] > 0
    (join,) = [line for line in lines if line.get("name") == "join"]
    assert all(isinstance(t, float) for t in join["all_s"])
    (ff,) = [line for line in lines if line.get("name") == "false_failures"]
    assert ff["false_failures"] == 0
