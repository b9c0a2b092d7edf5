"""Every bench runs: each ``bench/*.py`` with a ``--smoke`` mode is run as a subprocess (a second or
two per scenario, tiny sizes) and its results file must be complete and well formed.

Nothing here checks a speed. A bench that no longer starts, whose servers never become ready, or
whose parsers no longer understand a tool's output fails here instead of in front of a reader of
``bench/README.md``. Benches are found by their ``--smoke`` flag, so a new one is included when it
has one. ``pytest -m bench_smoke`` runs only these.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

from common import read_results  # noqa: E402

TIMEOUT = 90.0  # seconds per bench; their smoke modes take 1-25 s alone on a quiet 2-core machine

Lines = list[dict[str, Any]]


def _is_bench(path: Path) -> bool:
    text = path.read_text(encoding="utf-8")
    return 'if __name__ == "__main__":' in text and ("add_arguments(" in text or '"--smoke"' in text)


BENCHES = sorted(p.stem for p in BENCH.glob("*.py") if _is_bench(p))


def _results(lines: Lines, name: str) -> Lines:
    return [line for line in lines if line["name"] == name]


def _number(value: object) -> float:
    assert isinstance(value, int | float) and not isinstance(value, bool), f"{value!r} is not a number"
    assert math.isfinite(value)
    return float(value)


def _health_listener(lines: Lines) -> None:
    modes = {line["mode"]: line for line in lines if "mode" in line}
    assert sorted(modes) == ["bare", "bare-app", "in-process", "sidecar"]
    for mode, line in modes.items():
        wrk, fixed = line["wrk"], line["fixed_rate"]
        assert _number(wrk["requests"]) > 0, mode
        assert wrk["non_2xx"] == 0, f"{mode}: wrk got answers other than 200"
        assert {"p50", "p90", "p99"} <= set(wrk["latency_ms"]), mode
        for figure in (*wrk["latency_ms"].values(), wrk["requests_per_second"], line["server_cpu_us_per_request"],
                       line["server_rss_mb"], line["wrk_foreign_busy_percent"]):
            _number(figure)
        assert fixed["statuses"] == {"200": fixed["requests"]}, f"{mode}: fixed-rate answers other than 200"
        for figure in (*fixed["from_send_ms"].values(), *fixed["from_schedule_ms"].values()):
            _number(figure)
    assert set(_results(lines, "ratios")[0]["of_bare_requests_per_second"]) == set(modes)


def _failover(lines: Lines) -> None:
    flips = _results(lines, "flip")
    servers = {line["server"] for line in flips}
    assert servers == {"agent-interval-0.5", "pdns-interval-1"}
    labels = {(line["server"], line["label"].split()[-1], line["state"].split()[0]) for line in flips}
    assert ("agent-interval-0.5", "failover", "hang") in labels, "the hang extra did not run"
    for line in flips:  # the answer changed within the bench's deadline, and the check log was read
        for key in ("total", "to_check", "confirm", "dns_lag", "phase"):
            _number(line[key])
    assert _results(lines, "lost_check"), "no lost-check run"
    for line in _results(lines, "lost_check"):
        assert _number(line["polls"]) > 0 and isinstance(line["changed"], bool)
    assert {line["server"] for line in _results(lines, "summary")} == servers
    assert {line["server"] for line in _results(lines, "period")} == servers


def _kube_list(lines: Lines) -> None:
    (line,) = _results(lines, "list")
    assert line["services"] == 200
    for key in ("list_seconds", "rss_before_mb", "rss_with_cache_mb", "peak_rss_mb"):
        _number(line[key])


def _usage_churn(lines: Lines) -> None:
    (churn,) = _results(lines, "churn")
    (plane,) = _results(lines, "control_plane")
    assert churn["records_written"] > 0 and churn["records_written"] == churn["records_reported"]
    assert plane["records"] > 0
    # billed vs true seconds is not compared: at x30 every 10 ms of event lateness is 0.3 s billed
    for key in ("cpu_seconds", "cpu_seconds_per_sim_minute", "sim_minutes", "rss_mb"):
        _number(churn[key])
    _number(plane["billed_minus_true_seconds"])


def _proximity_eval(lines: Lines) -> None:
    scenarios = _results(lines, "scenario")
    assert len(scenarios) == 12  # 4 health scenarios x 3 samples
    for line in scenarios:
        _number(line["agree_percent"])
        for timing in ("cold", "exact", "hit"):
            _number(line[timing]["cpu_mean_us"])
    assert {"database", "warm", "memory", "scope_proofs"} <= {line["name"] for line in lines}


def _dns_throughput(lines: Lines) -> None:
    runs = [line for line in lines if line["name"].startswith("run ")]
    labels = {line["label"] for line in runs}
    assert {"pdns-static", "pdns-lua-shared", "pdns-lua-yes", "agent", "agent-nomemo", "agent-0x20",
            "agent-nomemo-0x20", "pdns-static-0x20", "pdns-static-0x20-ecs", "agent-0x20-ecs", "agent-nomemo-0x20-ecs",
            "pdns-random", "agent-random", "agent-random-hot"} <= labels
    for line in runs:
        assert line["completed"] > 0 and line["dnsperf_exit"] == 0, line["label"]
        _number(line["qps"])
        _number(line["us_per_query"])
        assert line["stray_threads"] == 0, f"{line['label']}: server threads off the server's core"
    sliced = {line["label"] for line in runs if line["slices"] > 1}
    assert {"pdns-static", "agent", "agent-nomemo", "pdns-random", "agent-random"} <= sliced  # interleaved
    ratios = [line for line in lines if line["name"].startswith("ratio ")]
    assert ratios and all(line["metric"] == "us_per_query" for line in ratios)
    assert {line["shape"] for line in ratios} == {"plain", "0x20", "0x20-ecs", "random"}
    hot = [line for line in runs if line["label"] == "agent-random-hot"]
    assert all(line["memo_hits"] > 0 for line in hot), "the hot name was never served from the memo"
    assert any(line["name"].startswith("ratio ") for line in lines)


def _dns_hot_path(lines: Lines) -> None:
    shapes = {line["shape"]: line for line in lines if line["name"].startswith("shape ")}
    assert set(shapes) == {"hit", "hit-0x20", "hit-0x20-ecs", "miss-0x20", "nxdomain"}
    assert all(_number(line["us_per_datagram"]) > 0 for line in shapes.values())


def _loop_stall(lines: Lines) -> None:
    for name in ("reload", "recompile"):
        (line,) = _results(lines, name)
        assert line["queries_sent"] > 0 and line["queries_answered"] == line["queries_sent"], name
        assert set(line["rcodes"]) == {"0"}, f"{name}: answers other than NOERROR while the zone changed"
        for key in ("longest_stall_ms", "longest_busy_cpu_ms", "seconds_to_new_tables", "worst_query_ms"):
            _number(line[key])


def _gossip_cluster(lines: Lines) -> None:
    (join,) = _results(lines, "join")
    assert join["n"] == 3 and _number(join["all_alive_from_launch_s"]) > 0
    (steady,) = _results(lines, "steady")
    for figure in ("cpu_seconds_per_agent_per_minute", "sent_bytes_per_s_per_agent"):
        _number(steady[figure]["median"])
    (acme,) = _results(lines, "acme")
    assert acme["agents_never_seen"] == 0 and acme["add"]["count"] == acme["delete"]["count"] > 0
    (copy,) = _results(lines, "copy_down")
    assert copy["agents_never_seen"] == 0 and copy["down_from_flip"]["count"] > 0
    (kill,) = _results(lines, "kill")
    assert kill["missing"] == 0 and _number(kill["all_s"]) > 0


def _probe_count(lines: Lines) -> None:
    (alone,) = _results(lines, "standalone")
    assert alone["copy_checks_per_check_interval"] == sum(alone["per_copy_checks"].values()) > 0
    assert alone["ingress_probes_per_interval"] == 0 and alone["agent_alive_at_end"]
    (cluster,) = _results(lines, "cluster")
    # loose bounds: a smoke window holds few rounds, on a loaded machine
    assert 0 < _number(cluster["ingress_probes_per_ingress_interval"]) <= 2 * cluster["expected_ingress_total"]
    assert set(cluster["ingress_probes_per_agent_per_ingress_interval"]) == set(
        cluster["own_region_checks_first_round"])
    assert all(_number(v) > 0 for v in cluster["own_region_checks_first_round"].values())
    assert cluster["agents_alive_at_end"]


CHECKS: dict[str, Callable[[Lines], None]] = {
    "probe_count": _probe_count,
    "gossip_cluster": _gossip_cluster,
    "dns_throughput": _dns_throughput,
    "dns_hot_path": _dns_hot_path,
    "loop_stall": _loop_stall,
    "health_listener": _health_listener,
    "failover": _failover,
    "kube_list": _kube_list,
    "usage_churn": _usage_churn,
    "proximity_eval": _proximity_eval,
}
TOOLS = {"health_listener": ("wrk",), "failover": ("dig", "pdns_server"),
         "dns_throughput": ("dig", "pdns_server", "dnsperf")}
PARALLEL = 4  # benches at once: most of a smoke run is waiting (for a check, a clock, a process to start)
# The longest smoke runs start first, so the shorter ones fill in beside them (a hint, not a rule).
LONGEST_FIRST = ("operator_scrape", "dns_tcp_abuse", "failover", "health_listener", "dns_throughput")


@dataclass
class Run:
    out: Path
    returncode: int | None  # None: killed after TIMEOUT
    stdout: str
    stderr: str


def _run(bench: str, folder: Path) -> Run:
    """``bench --smoke``; after TIMEOUT it gets SIGTERM (its processes are stopped by PID), then SIGKILL."""
    out = folder / f"{bench}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGION_AGENT_")}
    proc = subprocess.Popen([sys.executable, str(BENCH / f"{bench}.py"), "--smoke", "--out", str(out)], cwd=folder,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
        return Run(out, proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        return Run(out, None, stdout, stderr)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Run]]]:
    """Every selected bench's smoke run, started at once PARALLEL at a time; a test waits for its own."""
    selected = [str(item.callspec.params["bench"]) for item in request.session.items
                if isinstance(item, pytest.Function) and item.originalname == "test_bench_smoke"]
    runnable = [b for b in selected if all(shutil.which(tool) for tool in TOOLS.get(b, ()))]
    runnable.sort(key=lambda b: LONGEST_FIRST.index(b) if b in LONGEST_FIRST else len(LONGEST_FIRST))
    folder = tmp_path_factory.mktemp("bench-smoke")
    with ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="bench-smoke") as pool:
        yield {bench: pool.submit(_run, bench, folder) for bench in runnable}


@pytest.mark.bench_smoke
@pytest.mark.parametrize("bench", BENCHES)
def test_bench_smoke(bench: str, runs: dict[str, Future[Run]]) -> None:
    missing = [tool for tool in TOOLS.get(bench, ()) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (scripts/system-packages.sh)")
    run = runs[bench].result()
    output = f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
    assert run.returncode is not None, f"{bench} --smoke ran longer than {TIMEOUT} s\n{output}"
    assert run.returncode == 0, f"{bench} --smoke exited {run.returncode}\n{output}"
    assert f"results: {run.out}" in run.stdout, "the bench must name its results file at the end"
    check = CHECKS.get(bench)
    # benches of this list write through common.Results (command and versions in the run line)
    lines = read_results(run.out, strict=check is not None)
    assert lines[0]["smoke"] is True
    if check is not None:
        check(lines[1:-1])


@pytest.mark.bench_smoke
def test_known_benches_are_found() -> None:
    assert set(CHECKS) <= set(BENCHES)
