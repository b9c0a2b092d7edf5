"""The DNS throughput bench's slicing: runs cut into slices add up to the run they replace, and
only the max-rate runs of one round and shape are interleaved."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import dns_throughput as bench  # the bench directory is not a package: imported by path


def _run(**fields: object) -> bench.Run:
    return bench.Run("agent", None, Path("q"), **fields)  # type: ignore[arg-type]


def _slice(latencies: list[float], cpu: float, seconds: float, rcodes: str) -> bench.Run:
    part = _run()
    part.completed = part.sent = len(latencies)
    part.qps = len(latencies) / seconds
    part.avg_ms, part.sd_ms = statistics.fmean(latencies), statistics.pstdev(latencies)
    part.min_ms, part.max_ms = min(latencies), max(latencies)
    part.server_cpu, part.wall, part.background, part.rcodes = cpu, seconds, 10.0 * seconds, rcodes
    return part


def test_slices_add_up_to_one_run_of_all_their_queries() -> None:
    first, second = [1.0, 2.0, 3.0], [4.0, 6.0]
    whole = _run()
    whole.absorb(_slice(first, 0.5, 1.0, "NOERROR 3 (100.00%)"))
    whole.absorb(_slice(second, 1.5, 3.0, "NOERROR 1 (50.00%), NXDOMAIN 1 (50.00%)"))
    everything = first + second
    assert whole.slices == 2 and whole.completed == 5 and whole.server_cpu == pytest.approx(2.0)
    assert whole.us_per_query == pytest.approx(1e6 * 2.0 / 5)
    assert whole.qps == pytest.approx(5 / 4.0)
    assert whole.avg_ms == pytest.approx(statistics.fmean(everything))
    assert whole.sd_ms == pytest.approx(statistics.pstdev(everything))
    assert (whole.min_ms, whole.max_ms) == (1.0, 6.0)
    assert whole.background == pytest.approx((10.0 * 1 + 30.0 * 3) / 4)  # weighted by each slice's time
    assert whole.rcodes == "NOERROR 4 (80.00%), NXDOMAIN 1 (20.00%)"


def test_only_max_rate_runs_of_one_round_and_shape_are_interleaved() -> None:
    plan = [_run(round=1, shape="plain"), _run(round=1, shape="plain"), _run(round=1, shape="0x20"),
            _run(round=1), _run(round=2, shape="0x20"), _run(round=2, shape="0x20", fixed_qps=1000)]
    blocks = bench.interleaved_blocks(plan)
    assert [len(block) for block in blocks] == [2, 1, 1, 1, 1]
    assert [run for block in blocks for run in block] == plan
