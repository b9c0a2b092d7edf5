"""DNS throughput and latency: region-agent against PowerDNS 4.7 serving the same zone, in one run.

    python bench/dns_throughput.py                    # ~5 minutes: every run below, 15 s each
    python bench/dns_throughput.py --duration 5 --rounds 2

Started side by side on loopback (each stopped by PID when the bench ends), all checking the
same two fake copies (``tests/fakes/health_endpoint.py`` on 127.0.0.11/12, both ``ok``):

* ``pdns-shared``: PowerDNS 4.7, bind backend, ``enable-lua-records=shared``, default threads
  (receiver 1, distributor 3), zone of the anchor (``bench/anchors/pdns``): ``static A`` and the
  LUA ``ifurlup`` record ``shop``;
* ``pdns-yes``: the same with ``enable-lua-records=yes`` (PowerDNS's default LUA mode; reference);
* ``agent``: ``python -m agent run`` (uvloop, one process) on the equivalent zone file;
* ``agent-nomemo``: the same with ``REGION_AGENT_DNS__RESPONSE_MEMO_ENTRIES=0``.

The agent keeps a memo of rendered responses keyed by the query's bytes after the ID, so a
dnsperf run repeating one query measures the memo-hit path only. The cache-miss path is measured
with ``-0x20`` runs: the query file holds 30,000 distinct mixed-case spellings of the name (what
resolvers that use 0x20 case randomisation send), cycled in order, more than the 20,000-entry memo
holds, so no query is ever answered from the memo: each is parsed, looked up and rendered.
(``RESPONSE_MEMO_ENTRIES=0`` alone does not show it: the agent then still keeps the last
response, which a one-query file hits every time; reported to the lead.)

Load: ``dnsperf -c 10 -l <duration>`` (``-q 100`` outstanding, one send and one receive thread)
at full rate, then at a fixed ``-Q 1000`` with ``-v``, whose per-query latencies (µs resolution)
give the percentiles. ECS runs add ``-E 8:<ECS option>`` (192.0.2.0/24) to every query (dnsperf
can not vary it per query): the agent echoes ECS with scope 0 (an HA answer holds for every
client); PowerDNS, without ``edns-subnet-processing``, ignores it. ``agent-0x20-ecs`` (every
query a memo miss, with ECS parsed and echoed) is the cost a mix of many client subnets would pay.

For every run: queries/s, lost, rcodes, dnsperf's latency avg/min/max/stddev, percentiles
(fixed rate), the server's CPU from ``/proc/<pid>/stat`` (seconds, % of one core, µs per
query), dnsperf's CPU, and the rest of the machine's load during the run (``/proc/stat`` busy
minus everything this bench started). Ratios are computed from runs of the same round.
Goals (issue 2): agent >= 1.0x PowerDNS shared-LUA, >= 0.75x PowerDNS static, p99 < 1 ms at 1,000 q/s.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dns_rig import (
    HA_NAME,
    PRIMARY,
    STATIC_NAME,
    Endpoint,
    Procs,
    Server,
    busy_percent,
    cpu_seconds,
    dig,
    free_port,
    need_tools,
    proc_stat,
    start_agent,
    start_endpoint,
    start_pdns,
    wait_answer,
)

ECS_OPTION = "8:00011800c00002"  # family 1, source /24, scope 0, 192.0.2
CASE_VARIANTS = 30_000  # > the agent's default 20,000-entry response memo


def case_variants(name: str, count: int, seed: int = 20261129) -> list[str]:
    """``count`` distinct mixed-case spellings of ``name`` (0x20), in a fixed pseudo-random order."""
    letters = [i for i, c in enumerate(name) if c.isalpha()]
    if count > 2 ** len(letters):
        raise ValueError(f"{name} has only {2 ** len(letters)} spellings")
    masks = random.Random(seed).sample(range(2 ** len(letters)), count)
    out = []
    for mask in masks:
        chars = list(name)
        for bit, i in enumerate(letters):
            if mask >> bit & 1:
                chars[i] = chars[i].upper()
        out.append("".join(chars))
    return out


@dataclass
class Run:
    label: str
    server: Server
    qfile: Path
    extra: list[str] = field(default_factory=list)
    fixed_qps: int | None = None
    round: int = 0
    # results
    qps: float = 0.0
    sent: int = 0
    completed: int = 0
    lost: int = 0
    rcodes: str = ""
    avg_ms: float = 0.0
    min_ms: float = 0.0
    max_ms: float = 0.0
    sd_ms: float = 0.0
    pct: dict[str, float] = field(default_factory=dict)
    server_cpu: float = 0.0
    dnsperf_cpu: float = 0.0
    background: float = 0.0  # % of all cores busy with processes this bench did not start
    wall: float = 0.0

    @property
    def us_per_query(self) -> float:
        return 1e6 * self.server_cpu / self.completed if self.completed else 0.0


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def parse_dnsperf(text: str, run: Run) -> None:
    def grab(pattern: str) -> re.Match[str] | None:
        return re.search(pattern, text, re.MULTILINE)

    if m := grab(r"Queries sent:\s+(\d+)"):
        run.sent = int(m.group(1))
    if m := grab(r"Queries completed:\s+(\d+)"):
        run.completed = int(m.group(1))
    if m := grab(r"Queries lost:\s+(\d+)"):
        run.lost = int(m.group(1))
    if m := grab(r"Response codes:\s+(.*)$"):
        run.rcodes = m.group(1).strip()
    if m := grab(r"Queries per second:\s+([\d.]+)"):
        run.qps = float(m.group(1))
    if m := grab(r"Average Latency \(s\):\s+([\d.]+) \(min ([\d.]+), max ([\d.]+)\)"):
        run.avg_ms, run.min_ms, run.max_ms = (1000 * float(g) for g in m.groups())
    if m := grab(r"Latency StdDev \(s\):\s+([\d.]+)"):
        run.sd_ms = 1000 * float(m.group(1))
    if run.fixed_qps:
        latencies = sorted(1000 * float(line.split()[-1]) for line in text.splitlines() if line.startswith("> "))
        if latencies:
            run.pct = {f"p{p:g}": percentile(latencies, p) for p in (50, 90, 99, 99.9)}
            run.pct["n"] = len(latencies)


def execute(run: Run, duration: int, clients: int, ours: list[int], tmp: Path) -> None:
    argv = ["dnsperf", "-s", "127.0.0.1", "-p", str(run.server.port), "-d", str(run.qfile), "-c", str(clients),
            "-l", str(duration), *run.extra]
    if run.fixed_qps:
        argv += ["-Q", str(run.fixed_qps), "-v"]
    cpu0 = {pid: cpu_seconds(pid) for pid in ours}
    child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, total0 = proc_stat()
    t0 = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=False)
    run.wall = time.monotonic() - t0
    busy1, total1 = proc_stat()
    child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu1 = {pid: cpu_seconds(pid) for pid in ours}
    run.server_cpu = cpu1[run.server.pid] - cpu0[run.server.pid]
    run.dnsperf_cpu = (child1.ru_utime + child1.ru_stime) - (child0.ru_utime + child0.ru_stime)
    ours_cpu = sum(cpu1[p] - cpu0[p] for p in ours) + run.dnsperf_cpu
    run.background = max(0.0, 100.0 * ((busy1 - busy0) - ours_cpu) / (total1 - total0)) if total1 > total0 else 0.0
    (tmp / f"dnsperf-{run.round}-{run.label}{'-fixed' if run.fixed_qps else ''}.txt").write_text(
        " ".join(argv) + "\n" + out.stdout + out.stderr, encoding="utf-8")
    parse_dnsperf(out.stdout, run)
    if out.returncode != 0 or not run.completed:
        print(f"    !! dnsperf exit {out.returncode}: {(out.stderr or out.stdout)[-400:]}", flush=True)


def show(run: Run, duration: int) -> None:
    kind = f"-Q {run.fixed_qps}" if run.fixed_qps else "max rate"
    print(f"--- [{run.round}] {run.label} ({kind}) -> {run.server.name}:{run.server.port} {' '.join(run.extra)}")
    print(f"    queries/s={run.qps:,.0f}  sent={run.sent} completed={run.completed} lost={run.lost}  rcodes: "
          f"{run.rcodes}")
    print(f"    latency avg={run.avg_ms:.3f} ms  min={run.min_ms:.3f}  max={run.max_ms:.3f}  stddev={run.sd_ms:.3f}")
    if run.pct:
        pct = run.pct
        print(f"    per-query latency (dnsperf -v, n={pct['n']:.0f}): p50={pct['p50']:.3f} ms  p90={pct['p90']:.3f}  "
              f"p99={pct['p99']:.3f}  p99.9={pct['p99.9']:.3f}")
    print(f"    server CPU={run.server_cpu:.2f} s ({100 * run.server_cpu / duration:.0f}% of one core, "
          f"{run.us_per_query:.1f} µs/query); dnsperf CPU={run.dnsperf_cpu:.2f} s; other load on the machine "
          f"during the run: {run.background:.0f}% of all cores", flush=True)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--duration", type=int, default=15, help="seconds per dnsperf run (-l)")
    parser.add_argument("--clients", type=int, default=10, help="dnsperf -c")
    parser.add_argument("--fixed-qps", type=int, default=1000, help="dnsperf -Q of the latency runs")
    parser.add_argument("--rounds", type=int, default=1, help="times to repeat the max-rate block")
    parser.add_argument("--no-yes", action="store_true", help="skip PowerDNS enable-lua-records=yes")
    parser.add_argument("--keep-tmp", action="store_true", help="keep configs, logs and raw dnsperf output")
    args = parser.parse_args()
    if not 1 <= args.duration <= 120 or not 1 <= args.rounds <= 10:
        parser.error("--duration 1..120 and --rounds 1..10")
    need_tools("pdns_server", "dnsperf", "dig")

    tmp = Path(tempfile.mkdtemp(prefix="dns-throughput."))
    versions = subprocess.run(["pdns_server", "--version"], capture_output=True, text=True, check=False)
    pdns_version = re.findall(r"PowerDNS Authoritative Server [\d.]+", versions.stderr + versions.stdout)
    versions = subprocess.run(["dnsperf", "-h"], capture_output=True, text=True, check=False)
    dnsperf_version = re.findall(r"Version ([\d.]+)", versions.stderr + versions.stdout)
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  cores: {len(os.sched_getaffinity(0))}  "
          f"tmp: {tmp}")
    print(f"versions: {pdns_version[0] if pdns_version else 'pdns ?'}; dnsperf "
          f"{dnsperf_version[0] if dnsperf_version else '?'}; Python {platform.python_version()}")
    print(f"background before start: {busy_percent(3):.0f}% of all cores busy (3 s sample of /proc/stat, "
          "processes of other users of this machine)", flush=True)
    runs: list[Run] = []
    try:
        with Procs(tmp) as procs:
            health_port = free_port(("127.0.0.11", "127.0.0.12"), udp=False)
            endpoints: list[Endpoint] = [start_endpoint(procs, "copy-sfo1", "127.0.0.11", health_port),
                                         start_endpoint(procs, "copy-ams1", "127.0.0.12", health_port)]
            pdns = start_pdns(procs, "pdns-shared", health_port, lua="shared")
            pdns_yes = None if args.no_yes else start_pdns(procs, "pdns-yes", health_port, lua="yes")
            agent = start_agent(procs, "agent", health_port)
            nomemo = start_agent(procs, "agent-nomemo", health_port,
                                 env={"REGION_AGENT_DNS__RESPONSE_MEMO_ENTRIES": "0"})
            servers = [s for s in (pdns, pdns_yes, agent, nomemo) if s is not None]
            for server in servers:
                waited = wait_answer(server, PRIMARY, 30)
                print(f"{server.name}: pid {server.pid}, port {server.port}, {server.threads()} threads, "
                      f"{server.notes}; '{HA_NAME} A' = {PRIMARY} after {waited:.2f} s")
            ecs_reply = subprocess.run(["dig", "@127.0.0.1", "-p", str(agent.port), HA_NAME, "A",
                                        "+subnet=192.0.2.0/24", "+time=1", "+tries=1"],
                                       capture_output=True, text=True, timeout=5, check=False).stdout
            echo = re.findall(r"CLIENT-SUBNET: (\S+)", ecs_reply)
            print(f"static check: {dig(pdns.port, STATIC_NAME)}; agent's ECS echo to 192.0.2.0/24: "
                  f"{echo[0] if echo else 'none'} (address/source/scope)")
            qstatic = tmp / "queries-static.txt"
            qstatic.write_text(f"{STATIC_NAME} A\n", encoding="utf-8")
            qha = tmp / "queries-ha.txt"
            qha.write_text(f"{HA_NAME} A\n", encoding="utf-8")
            q20 = tmp / "queries-ha-0x20.txt"
            q20.write_text("".join(f"{n} A\n" for n in case_variants(HA_NAME, CASE_VARIANTS)), encoding="utf-8")
            ours = [s.pid for s in servers] + [e.proc.pid for e in endpoints]
            ecs = ["-E", ECS_OPTION]

            plan: list[Run] = []
            for rnd in range(1, args.rounds + 1):
                plan += [Run("pdns-static", pdns, qstatic, round=rnd),
                         Run("pdns-lua-shared", pdns, qha, round=rnd),
                         Run("agent", agent, qha, round=rnd),
                         Run("agent-0x20", agent, q20, round=rnd),
                         Run("agent-nomemo-0x20", nomemo, q20, round=rnd),
                         Run("agent-ecs", agent, qha, ecs, round=rnd),
                         Run("agent-0x20-ecs", agent, q20, ecs, round=rnd),
                         Run("pdns-lua-shared-0x20", pdns, q20, round=rnd)]
                if pdns_yes is not None:
                    plan.append(Run("pdns-lua-yes", pdns_yes, qha, round=rnd))
            q = args.fixed_qps
            plan += [Run("pdns-static", pdns, qstatic, fixed_qps=q),
                     Run("pdns-lua-shared", pdns, qha, fixed_qps=q),
                     Run("agent", agent, qha, fixed_qps=q),
                     Run("agent-0x20", agent, q20, fixed_qps=q),
                     Run("agent-0x20-ecs", agent, q20, ecs, fixed_qps=q)]
            if pdns_yes is not None:
                plan.append(Run("pdns-lua-yes", pdns_yes, qha, fixed_qps=q))
            print(f"\n{len(plan)} dnsperf runs of {args.duration} s, -c {args.clients} (default -q 100):", flush=True)
            for run in plan:
                execute(run, args.duration, args.clients, ours, tmp)
                runs.append(run)
                show(run, args.duration)
            for server in servers:
                answer = dig(server.port, HA_NAME)
                print(f"after the runs: {server.name} answers {answer!r}")
                if server.proc.poll() is not None:
                    print(f"!! {server.name} exited: {server.log.read_text()[-1000:]}")
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    summarize(runs, args)
    return 0


def summarize(runs: list[Run], args: argparse.Namespace) -> None:
    print("\n==================== SUMMARY ====================")
    print(f"{'run':<20} {'rate':>8} {'queries/s':>10} {'avg ms':>7} {'p99 ms':>7} {'max ms':>7} {'lost':>5} "
          f"{'srv CPU %':>9} {'µs/q':>6} {'bg %':>5}")
    for run in runs:
        rate = f"-Q {run.fixed_qps}" if run.fixed_qps else f"max r{run.round}"
        p99 = f"{run.pct['p99']:.3f}" if run.pct else "-"
        print(f"{run.label:<20} {rate:>8} {run.qps:>10,.0f} {run.avg_ms:>7.3f} {p99:>7} {run.max_ms:>7.2f} "
              f"{run.lost:>5} {100 * run.server_cpu / args.duration:>9.0f} {run.us_per_query:>6.1f} "
              f"{run.background:>5.0f}")
    print("\nratios of queries/s (same round):")
    rounds = sorted({r.round for r in runs if not r.fixed_qps})
    by = {(r.round, r.label): r for r in runs if not r.fixed_qps}
    keep: dict[str, list[float]] = {}
    for rnd in rounds:
        def qps(label: str, rnd: int = rnd) -> float:
            run = by.get((rnd, label))
            return run.qps if run else 0.0

        pairs = [("agent / pdns-lua-shared", "agent", "pdns-lua-shared", 1.0),
                 ("agent / pdns-static", "agent", "pdns-static", 0.75),
                 ("agent-0x20 / pdns-lua-shared", "agent-0x20", "pdns-lua-shared", 1.0),
                 ("agent-0x20 / pdns-static", "agent-0x20", "pdns-static", 0.75),
                 ("agent-nomemo-0x20 / pdns-lua-shared", "agent-nomemo-0x20", "pdns-lua-shared", 1.0),
                 ("agent-ecs / pdns-lua-shared", "agent-ecs", "pdns-lua-shared", 1.0),
                 ("agent-0x20-ecs / pdns-lua-shared", "agent-0x20-ecs", "pdns-lua-shared", 1.0),
                 ("agent-0x20 / pdns-lua-shared-0x20", "agent-0x20", "pdns-lua-shared-0x20", 1.0),
                 ("pdns-lua-shared / pdns-static", "pdns-lua-shared", "pdns-static", 0.0),
                 ("agent / pdns-lua-yes", "agent", "pdns-lua-yes", 0.0)]
        for name, a, b, goal in pairs:
            if qps(a) and qps(b):
                value = qps(a) / qps(b)
                keep.setdefault(name, []).append(value)
                verdict = f"  goal >= {goal:.2f}: {'met' if value >= goal else 'MISSED'}" if goal else ""
                print(f"  round {rnd}: {name:<36} {ratio(qps(a), qps(b)):>6}{verdict}")
    if len(rounds) > 1:
        for name, values in keep.items():
            print(f"  median over {len(values)} rounds: {name:<36} {statistics.median(values):.2f}")
    for run in runs:
        if run.fixed_qps and run.pct and run.label.startswith("agent"):
            verdict = "met" if run.pct["p99"] < 1.0 else "MISSED"
            print(f"  p99 at {run.fixed_qps} q/s, {run.label}: {run.pct['p99']:.3f} ms (goal < 1 ms: {verdict})")


if __name__ == "__main__":
    sys.exit(main())
