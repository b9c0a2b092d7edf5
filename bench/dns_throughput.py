"""DNS server CPU per query, per core: region-agent against PowerDNS 4.7 serving the same zone, in one run.

    python bench/dns_throughput.py                    # every run below, 15 s each, one round
    python bench/dns_throughput.py --duration 8 --rounds 2 --no-yes
    python bench/dns_throughput.py --smoke            # 1 s runs, tiny query files: does every path work?

**Per core.** The bench pins itself, and so dnsperf, dig and the fake copies it starts, to
``--load-cpu`` (0), and every server under test, all of its threads (PowerDNS has a receiver,
distributors and health-check threads; the agent its executor threads), to ``--server-cpu`` (1),
as ``taskset -a -p -c 1 <pid>`` does (``os.sched_setaffinity`` on every ``/proc/<pid>/task``,
checked again after every run). One server is loaded at a time, by the same dnsperf with the
same arguments, so every server runs under identical conditions: one core of its own, the load
generator on the other. The figure compared is the server's CPU per answered query (utime +
stime of all its threads from ``/proc/<pid>/stat`` over the run ÷ queries completed), which
does not depend on how fast dnsperf can send; queries/s is shown beside it. ``--no-pin`` runs
unpinned (the old behaviour).

Servers started side by side on loopback (each stopped by PID when the bench ends), all checking
the same two fake copies (``region_agent/demo/fake_copy.py`` on 127.0.0.11/12, both ``ok``):

* ``pdns-shared``: PowerDNS 4.7, bind backend, ``enable-lua-records=shared``, default threads
  (receiver 1, distributor 3), zone of the anchor (``bench/anchors/pdns``): ``static A`` and the
  LUA ``ifurlup`` record ``shop``; its packet cache on (the default), as deployed;
* ``pdns-yes``: the same with ``enable-lua-records=yes`` (PowerDNS's default LUA mode; reference);
* ``agent``: ``python -m agent run`` (uvloop, one process) on the equivalent zone file;
* ``agent-nomemo``: the same with ``REGION_AGENT_DNS__RESPONSE_MEMO_ENTRIES=0``: every query is
  parsed, looked up and rendered (the memo-miss path).

Query shapes, each sent to PowerDNS's static record, its LUA record and the agent (memo on: hits;
memo off: misses): ``plain`` one name; ``0x20`` 30,000 distinct mixed-case spellings of the name
cycled in order (what resolvers that randomise case send; the agent's memo is case-blind, so for
``agent`` they are hits after the first round); ``0x20-ecs`` the same with an EDNS Client Subnet
option (``-E 8:<ECS>``, 192.0.2.0/24; dnsperf can not vary it per query: the agent echoes it with
scope 0, PowerDNS without ``edns-subnet-processing`` ignores it); ``random`` 30,000 random names
under the zone (a random-subdomain flood, every answer NXDOMAIN, never memoised), against
PowerDNS and the agent; ``agent-random-hot``: the same flood with every fourth query the hot name
(in random case): the share of memo hits shows whether the flood evicted it.

Load: ``dnsperf -c 10 -l <duration>`` (``-q 100`` outstanding, one send and one receive thread)
at full rate, then at a fixed ``-Q 1000`` with ``-v``, whose per-query latencies (µs resolution)
give the percentiles.

**Interleaved.** This VM's cores slow down for seconds at a time (the same in-process timing
of the NXDOMAIN path took 1.1 µs and then 2.0 µs per parse one second later, all figures
×1.7): two servers measured one after the other can land on different sides of such an
episode. So the max-rate runs of one round and shape are cut into ``--slices`` (4) dnsperf runs
of ``duration / slices`` seconds, run by turns in ABBA order (A B C D, D C B A, ...), and each
run's figures are the sums over its slices (queries, CPU; latency pooled). The fixed-rate runs
are not sliced.

For every run: queries/s, lost, rcodes, dnsperf's latency avg/min/max/stddev, percentiles
(fixed rate), the server's CPU (seconds, % of one core, µs per query), dnsperf's CPU, the rest
of the machine's load during the run (``/proc/stat`` busy minus everything this bench started;
with pinning also the foreign load on the server's core, from ``/proc/stat``'s ``cpu<N>`` line)
and, for the agent, the memo hits it counted. Ratios are of **µs per query** within one round:
each agent run ÷ PowerDNS static and ÷ PowerDNS LUA of the same query shape (lower is better).
Goals (issue 23): memo hit <= 1.0x PowerDNS static, memo miss (0x20, ECS) <= 1.2x, NXDOMAIN
flood <= 1.2x (÷ PowerDNS's NXDOMAIN run). Every run writes its raw results as JSON lines
(``bench/common.py``) to the file it names at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Results, add_arguments, start_agent, start_pdns
from dns_rig import (
    AGENT_ZONE,
    CLK_TCK,
    HA_NAME,
    PRIMARY,
    STATIC_NAME,
    ZONE,
    Endpoint,
    Procs,
    Server,
    busy_percent,
    cpu_seconds,
    dig,
    free_port,
    ifurlup_record,
    need_tools,
    proc_stat,
    start_endpoint,
    wait_answer,
)

ECS_OPTION = "8:00011800c00002"  # family 1, source /24, scope 0, 192.0.2
VARIANTS = 30_000  # query-file lines of the 0x20 and random-subdomain runs (> the 20,000-entry memo)
SMOKE_VARIANTS = 300


def pdns_zone(health_port: int) -> str:
    """The anchor's zone: SOA, NS, a static A and the LUA ifurlup record."""
    return "\n".join([
        f"$ORIGIN {ZONE}.", "$TTL 300", f"@ IN SOA ns1.{ZONE}. hostmaster.{ZONE}. 1 3600 600 604800 60",
        f"@ IN NS ns1.{ZONE}.", "ns1 IN A 192.0.2.53", "static IN A 192.0.2.1", ifurlup_record(health_port),
    ]) + "\n"


def random_names(count: int, seed: int = 20261130) -> list[str]:
    """``count`` random names under the zone (none of them exists), in a fixed pseudo-random order."""
    rng = random.Random(seed)
    return [f"{rng.getrandbits(48):012x}.{ZONE}" for _ in range(count)]


def memo_hits(server: Server) -> int | None:
    """The agent's region_agent_dns_memo_hits_total from its operator listener, None if unreadable."""
    if server.metrics_port is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    found = re.search(r"^region_agent_dns_memo_hits_total (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else None


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


def pin(pid: int, cpu: int) -> int:
    """Every thread of ``pid`` onto ``cpu``, as ``taskset -a -p -c <cpu> <pid>``; returns how many."""
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # a thread that ended meanwhile
            continue
        pinned += 1
    return pinned


def stray_threads(pid: int, cpu: int) -> list[int]:
    """Threads of ``pid`` allowed on any core but ``cpu`` (should be none while pinned)."""
    stray = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getaffinity(int(tid)) != {cpu}:
                stray.append(int(tid))
        except OSError:
            continue
    return stray


def core_stat(cpu: int) -> tuple[float, float]:
    """(busy, total) seconds of one core since boot, from its ``cpu<N>`` line in /proc/stat."""
    with open("/proc/stat", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(f"cpu{cpu} "):
                values = [int(v) for v in line.split()[1:9]]
                total = sum(values)
                return (total - values[3] - values[4]) / CLK_TCK, total / CLK_TCK
    return 0.0, 0.0


@dataclass
class Run:
    label: str
    server: Server
    qfile: Path
    extra: list[str] = field(default_factory=list)
    fixed_qps: int | None = None
    round: int = 0
    shape: str = ""  # plain, 0x20, 0x20-ecs, random (the per-shape ratios), or '' (no ratio)
    kind: str = ""  # pdns-static, pdns-lua, agent-hit, agent-miss, pdns-nxdomain, agent-nxdomain
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
    memo_hits: int | None = None  # the agent's memo hits during the run
    dnsperf_exit: int = 0
    server_core_busy: float | None = None  # % of the server's core busy during the run (pinned runs)
    server_core_other: float | None = None  # of which not the server under test (idle servers, foreign work)
    stray: int = 0  # server threads found off the server's core after the run (pinned runs; should be 0)

    slices: int = 0  # dnsperf runs summed into this one (see ``absorb``)

    def absorb(self, part: Run) -> None:
        """Add one slice's figures: counts and CPU summed, latency pooled, shares weighted by time."""
        n0, n1 = self.completed, part.completed
        n = n0 + n1
        if n:
            mean = (self.avg_ms * n0 + part.avg_ms * n1) / n
            square = (n0 * (self.sd_ms ** 2 + self.avg_ms ** 2) + n1 * (part.sd_ms ** 2 + part.avg_ms ** 2)) / n
            self.avg_ms, self.sd_ms = mean, max(0.0, square - mean ** 2) ** 0.5
        seconds = (n0 / self.qps if self.qps else 0.0) + (n1 / part.qps if part.qps else 0.0)  # dnsperf's run time
        self.qps = n / seconds if seconds else 0.0
        self.min_ms = min(self.min_ms, part.min_ms) if self.slices else part.min_ms
        self.max_ms = max(self.max_ms, part.max_ms)
        wall = self.wall + part.wall

        def weighted(mine: float | None, theirs: float | None) -> float | None:
            if theirs is None or wall <= 0:
                return mine
            return theirs if mine is None or not self.slices else (mine * self.wall + theirs * part.wall) / wall
        self.background = weighted(self.background, part.background) or 0.0
        self.server_core_busy = weighted(self.server_core_busy, part.server_core_busy)
        self.server_core_other = weighted(self.server_core_other, part.server_core_other)
        self.rcodes = merge_rcodes(self.rcodes, part.rcodes)
        self.sent += part.sent
        self.completed = n
        self.lost += part.lost
        self.server_cpu += part.server_cpu
        self.dnsperf_cpu += part.dnsperf_cpu
        self.wall = wall
        self.memo_hits = (None if part.memo_hits is None or (self.slices and self.memo_hits is None)
                          else (self.memo_hits or 0) + part.memo_hits)
        self.dnsperf_exit = self.dnsperf_exit or part.dnsperf_exit
        self.stray = max(self.stray, part.stray)
        self.pct = part.pct or self.pct  # only fixed-rate runs have percentiles, and they are never sliced
        self.slices += 1

    @property
    def us_per_query(self) -> float:
        return 1e6 * self.server_cpu / self.completed if self.completed else 0.0

    def record(self) -> dict[str, Any]:
        """The run as a results-file line."""
        return {
            "label": self.label, "server": self.server.name, "round": self.round, "queries": self.qfile.name,
            "extra": self.extra, "fixed_qps": self.fixed_qps, "qps": self.qps, "sent": self.sent,
            "completed": self.completed, "lost": self.lost, "rcodes": self.rcodes,
            "latency_ms": {"avg": self.avg_ms, "min": self.min_ms, "max": self.max_ms, "stddev": self.sd_ms,
                           **self.pct},
            "server_cpu_s": round(self.server_cpu, 3), "us_per_query": round(self.us_per_query, 2),
            "dnsperf_cpu_s": round(self.dnsperf_cpu, 3), "background_percent": round(self.background, 1),
            "wall_s": round(self.wall, 2), "memo_hits": self.memo_hits, "dnsperf_exit": self.dnsperf_exit,
            "shape": self.shape, "kind": self.kind,
            "server_core_busy_percent": None if self.server_core_busy is None else round(self.server_core_busy, 1),
            "server_core_other_percent": None if self.server_core_other is None else round(self.server_core_other, 1),
            "stray_threads": self.stray, "slices": self.slices,
        }


def merge_rcodes(first: str, second: str) -> str:
    """Two of dnsperf's 'Response codes:' lines as one: counts summed per code."""
    counts: dict[str, int] = {}
    for text in (first, second):
        for code, count in re.findall(r"([A-Z]+) (\d+)", text):
            counts[code] = counts.get(code, 0) + int(count)
    total = sum(counts.values())
    return ", ".join(f"{code} {count} ({100 * count / total:.2f}%)" for code, count in counts.items()) if total else ""


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


def execute(whole: Run, duration: float, clients: int, ours: list[int], tmp: Path, server_cpu: int | None) -> None:
    """One dnsperf run of ``duration`` seconds against ``whole``'s server, its figures added to ``whole``."""
    run = Run(whole.label, whole.server, whole.qfile, whole.extra, whole.fixed_qps, whole.round, whole.shape,
              whole.kind)
    argv = ["dnsperf", "-s", "127.0.0.1", "-p", str(run.server.port), "-d", str(run.qfile), "-c", str(clients),
            "-l", f"{duration:g}", *run.extra]
    if run.fixed_qps:
        argv += ["-Q", str(run.fixed_qps), "-v"]
    hits0 = memo_hits(run.server) if run.server.name.startswith("agent") else None
    cpu0 = {pid: cpu_seconds(pid) for pid in ours}
    child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, total0 = proc_stat()
    core0 = core_stat(server_cpu) if server_cpu is not None else (0.0, 0.0)
    t0 = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=False)
    run.wall = time.monotonic() - t0
    busy1, total1 = proc_stat()
    core1 = core_stat(server_cpu) if server_cpu is not None else (0.0, 0.0)
    child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu1 = {pid: cpu_seconds(pid) for pid in ours}
    hits1 = memo_hits(run.server) if hits0 is not None else None
    run.memo_hits = hits1 - hits0 if hits0 is not None and hits1 is not None else None
    run.server_cpu = cpu1[run.server.pid] - cpu0[run.server.pid]
    run.dnsperf_cpu = (child1.ru_utime + child1.ru_stime) - (child0.ru_utime + child0.ru_stime)
    ours_cpu = sum(cpu1[p] - cpu0[p] for p in ours) + run.dnsperf_cpu
    run.background = max(0.0, 100.0 * ((busy1 - busy0) - ours_cpu) / (total1 - total0)) if total1 > total0 else 0.0
    if server_cpu is not None and core1[1] > core0[1]:
        span = core1[1] - core0[1]
        run.server_core_busy = 100.0 * (core1[0] - core0[0]) / span
        run.server_core_other = max(0.0, run.server_core_busy - 100.0 * run.server_cpu / span)
        run.stray = len(stray_threads(run.server.pid, server_cpu))
    (tmp / f"dnsperf-{run.round}-{run.label}{'-fixed' if run.fixed_qps else ''}-{whole.slices}.txt").write_text(
        " ".join(argv) + "\n" + out.stdout + out.stderr, encoding="utf-8")
    parse_dnsperf(out.stdout, run)
    run.dnsperf_exit = out.returncode
    if out.returncode != 0 or not run.completed:
        print(f"    !! dnsperf exit {out.returncode}: {(out.stderr or out.stdout)[-400:]}", flush=True)
    whole.absorb(run)


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
    if run.server_core_busy is not None:
        print(f"    server's core: {run.server_core_busy:.0f}% busy, {run.server_core_other:.0f}% of it not this "
              f"server; threads off the core: {run.stray}", flush=True)
    if run.memo_hits is not None and run.completed:
        print(f"    memo hits: {run.memo_hits} ({100 * run.memo_hits / run.completed:.1f}% of answers)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--duration", type=int, default=15, help="seconds per dnsperf run (-l)")
    parser.add_argument("--clients", type=int, default=10, help="dnsperf -c")
    parser.add_argument("--fixed-qps", type=int, default=1000, help="dnsperf -Q of the latency runs")
    parser.add_argument("--rounds", type=int, default=1, help="times to repeat the max-rate block")
    parser.add_argument("--slices", type=int, default=4,
                        help="slices each max-rate run is cut into, interleaved with the other runs of its shape")
    parser.add_argument("--no-yes", action="store_true", help="skip PowerDNS enable-lua-records=yes")
    parser.add_argument("--keep-tmp", action="store_true", help="keep configs, logs and raw dnsperf output")
    parser.add_argument("--server-cpu", type=int, default=1, help="core every server under test is pinned to")
    parser.add_argument("--load-cpu", type=int, default=0, help="core of dnsperf (and of this bench and its helpers)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin (servers and dnsperf share all cores)")
    add_arguments(parser)
    args = parser.parse_args()
    if not 1 <= args.duration <= 120 or not 1 <= args.rounds <= 10 or not 1 <= args.slices <= args.duration:
        parser.error("--duration 1..120, --rounds 1..10 and --slices 1..duration")
    if args.smoke:  # every server and every run, a second each, tiny files: it works, it measures nothing
        args.duration, args.rounds, args.fixed_qps, args.no_yes, args.slices = 1, 1, 200, False, 2
    need_tools("pdns_server", "dnsperf", "dig")
    variants = SMOKE_VARIANTS if args.smoke else VARIANTS
    cores = os.sched_getaffinity(0)
    if not args.no_pin and (not {args.server_cpu, args.load_cpu} <= cores or args.server_cpu == args.load_cpu):
        print(f"!! can not pin: cores {sorted(cores)} do not hold two distinct --server-cpu {args.server_cpu} and "
              f"--load-cpu {args.load_cpu}; running unpinned", flush=True)
        args.no_pin = True
    if not args.no_pin:
        os.sched_setaffinity(0, {args.load_cpu})  # dnsperf, dig and the fake copies inherit it

    tmp = Path(tempfile.mkdtemp(prefix="dns-throughput."))
    pinning = "unpinned" if args.no_pin else (f"servers (all threads) on CPU {args.server_cpu}, dnsperf and helpers "
                                              f"on CPU {args.load_cpu}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  cores: {len(cores)}  {pinning}  "
          f"tmp: {tmp}")
    print(f"background before start: {busy_percent(0.3 if args.smoke else 3):.0f}% of all cores busy (/proc/stat, "
          "processes of other users of this machine)", flush=True)
    runs: list[Run] = []
    with Results("dns_throughput", args.out, smoke=args.smoke, tools=("pdns_server", "dnsperf", "dig")) as results:
        try:
            with Procs(tmp) as procs:
                runs = measure(procs, tmp, args, variants, results)
        finally:
            if not args.keep_tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        summary = summarize(runs, args)
        for name, value in summary.items():
            results.add(name, **value)
        if args.smoke:
            check_smoke(runs)
    return 0


def measure(procs: Procs, tmp: Path, args: argparse.Namespace, variants: int, results: Results) -> list[Run]:
    health_port = free_port(("127.0.0.11", "127.0.0.12"), udp=False)
    endpoints: list[Endpoint] = [start_endpoint(procs, "copy-sfo1", "127.0.0.11", health_port),
                                 start_endpoint(procs, "copy-ams1", "127.0.0.12", health_port)]
    pdns = start_pdns(procs, "pdns-shared", pdns_zone(health_port), lua="shared")
    pdns_yes = None if args.no_yes else start_pdns(procs, "pdns-yes", pdns_zone(health_port), lua="yes")
    checks = {"port": health_port, "interval": 5.0, "timeout": 2.0}
    agent = start_agent(procs, "agent", AGENT_ZONE, checks=checks)
    nomemo = start_agent(procs, "agent-nomemo", AGENT_ZONE, checks=checks,
                         env={"REGION_AGENT_DNS__RESPONSE_MEMO_ENTRIES": "0"})
    servers = [s for s in (pdns, pdns_yes, agent, nomemo) if s is not None]
    server_cpu = None if args.no_pin else args.server_cpu
    for server in servers:
        waited = wait_answer(server, PRIMARY, 30)
        pinned = pin(server.pid, server_cpu) if server_cpu is not None else 0
        where = f"all {pinned} threads pinned to CPU {server_cpu}" if server_cpu is not None else "unpinned"
        print(f"{server.name}: pid {server.pid}, port {server.port}, {server.threads()} threads ({where}), "
              f"{server.notes}; '{HA_NAME} A' = {PRIMARY} after {waited:.2f} s")
        results.add(f"server {server.name}", pid=server.pid, threads=server.threads(), notes=server.notes,
                    first_answer_s=round(waited, 3), pinned_cpu=server_cpu, threads_pinned=pinned,
                    load_cpu=None if args.no_pin else args.load_cpu)
    ecs_reply = subprocess.run(["dig", "@127.0.0.1", "-p", str(agent.port), HA_NAME, "A",
                                "+subnet=192.0.2.0/24", "+time=1", "+tries=1"],
                               capture_output=True, text=True, timeout=5, check=False).stdout
    echo = re.findall(r"CLIENT-SUBNET: (\S+)", ecs_reply)
    print(f"static check: {dig(pdns.port, STATIC_NAME)}; agent's ECS echo to 192.0.2.0/24: "
          f"{echo[0] if echo else 'none'} (address/source/scope)")

    def query_file(name: str, lines: list[str]) -> Path:
        path = tmp / f"queries-{name}.txt"
        path.write_text("".join(f"{line} A\n" for line in lines), encoding="utf-8")
        return path

    qstatic = query_file("static", [STATIC_NAME])
    qha = query_file("ha", [HA_NAME])
    spellings = case_variants(HA_NAME, variants)
    q20 = query_file("ha-0x20", spellings)
    qstatic20 = query_file("static-0x20", case_variants(STATIC_NAME, variants))
    randoms = random_names(variants)
    qrandom = query_file("random", randoms)
    qhot = query_file("random-hot", [spellings[i] if i % 4 == 0 else name for i, name in enumerate(randoms)])
    ours = [s.pid for s in servers] + [e.proc.pid for e in endpoints]
    ecs = ["-E", ECS_OPTION]

    plan: list[Run] = []
    for rnd in range(1, args.rounds + 1):
        plan += [  # per shape: PowerDNS static, PowerDNS LUA, the agent's memo hit and miss
            Run("pdns-static", pdns, qstatic, round=rnd, shape="plain", kind="pdns-static"),
            Run("pdns-lua-shared", pdns, qha, round=rnd, shape="plain", kind="pdns-lua"),
            Run("agent", agent, qha, round=rnd, shape="plain", kind="agent-hit"),
            Run("agent-nomemo", nomemo, qha, round=rnd, shape="plain", kind="agent-miss"),
            Run("pdns-static-0x20", pdns, qstatic20, round=rnd, shape="0x20", kind="pdns-static"),
            Run("pdns-lua-shared-0x20", pdns, q20, round=rnd, shape="0x20", kind="pdns-lua"),
            Run("agent-0x20", agent, q20, round=rnd, shape="0x20", kind="agent-hit"),
            Run("agent-nomemo-0x20", nomemo, q20, round=rnd, shape="0x20", kind="agent-miss"),
            Run("pdns-static-0x20-ecs", pdns, qstatic20, ecs, round=rnd, shape="0x20-ecs", kind="pdns-static"),
            Run("pdns-lua-shared-0x20-ecs", pdns, q20, ecs, round=rnd, shape="0x20-ecs", kind="pdns-lua"),
            Run("agent-0x20-ecs", agent, q20, ecs, round=rnd, shape="0x20-ecs", kind="agent-hit"),
            Run("agent-nomemo-0x20-ecs", nomemo, q20, ecs, round=rnd, shape="0x20-ecs", kind="agent-miss"),
            Run("pdns-random", pdns, qrandom, round=rnd, shape="random", kind="pdns-nxdomain"),
            Run("agent-random", agent, qrandom, round=rnd, shape="random", kind="agent-nxdomain"),
            Run("agent-random-hot", agent, qhot, round=rnd)]
        if pdns_yes is not None:
            plan.append(Run("pdns-lua-yes", pdns_yes, qha, round=rnd))
    q = args.fixed_qps
    fixed = [Run("pdns-static", pdns, qstatic, fixed_qps=q),
             Run("pdns-lua-shared", pdns, qha, fixed_qps=q),
             Run("agent", agent, qha, fixed_qps=q),
             Run("agent-0x20", agent, q20, fixed_qps=q),
             Run("agent-nomemo-0x20", nomemo, q20, fixed_qps=q),
             Run("agent-random", agent, qrandom, fixed_qps=q)]
    if pdns_yes is not None:
        fixed.append(Run("pdns-lua-yes", pdns_yes, qha, fixed_qps=q))
    plan += fixed[2:4] if args.smoke else fixed  # smoke: the fixed-rate path once per agent mode is enough
    print(f"\n{len(plan)} runs of {args.duration} s, -c {args.clients} (default -q 100); the max-rate runs of one "
          f"shape and round interleaved in {args.slices} slices:", flush=True)
    runs = []
    for block in interleaved_blocks(plan):
        slices = args.slices if block[0].shape and not block[0].fixed_qps else 1
        for k in range(slices):
            for run in block if k % 2 == 0 else block[::-1]:
                execute(run, args.duration / slices, args.clients, ours, tmp, server_cpu)
        for run in block:
            runs.append(run)
            show(run, args.duration)
            results.add(f"run {run.label}{' fixed' if run.fixed_qps else ''} r{run.round}", **run.record())
    for server in servers:
        answer = dig(server.port, HA_NAME)
        print(f"after the runs: {server.name} answers {answer!r}")
        if server.proc.poll() is not None:
            print(f"!! {server.name} exited: {server.log.read_text()[-1000:]}")
            raise RuntimeError(f"{server.name} exited during the bench")
    return runs


def interleaved_blocks(plan: list[Run]) -> list[list[Run]]:
    """The plan cut into blocks run side by side: consecutive max-rate runs of one round and shape
    (those whose µs per query are compared); every other run is a block of its own."""
    blocks: list[list[Run]] = []
    for run in plan:
        last = blocks[-1][0] if blocks else None
        if (last is not None and run.shape and not run.fixed_qps and not last.fixed_qps
                and (last.round, last.shape) == (run.round, run.shape)):
            blocks[-1].append(run)
        else:
            blocks.append([run])
    return blocks


def check_smoke(runs: list[Run]) -> None:
    """A smoke run proves only that every run produced a well-formed result."""
    problems = [f"{r.label}: exit {r.dnsperf_exit}, completed {r.completed}, qps {r.qps}, rcodes {r.rcodes!r}"
                for r in runs if r.dnsperf_exit != 0 or r.completed <= 0 or r.qps <= 0 or not r.rcodes]
    problems += [f"{r.label}: no memo hit count" for r in runs if r.server.name == "agent" and r.memo_hits is None]
    problems += [f"{r.label}: no percentiles" for r in runs if r.fixed_qps and not r.pct]
    if problems:
        raise SystemExit("smoke: " + "; ".join(problems))
    print(f"smoke: {len(runs)} runs, every one well formed")


# Goals of issue 23, µs per query of the agent ÷ PowerDNS static of the same shape (at most).
GOALS = {"agent-hit": 1.0, "agent-miss": 1.2, "agent-nxdomain": 1.2}
SHAPES = ("plain", "0x20", "0x20-ecs", "random")
REFERENCE = {"agent-nxdomain": "pdns-nxdomain"}  # what an NXDOMAIN run is compared with (static has none)


def summarize(runs: list[Run], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Print the summary and the per-core ratios of µs per query; return them for the results file."""
    print("\n==================== SUMMARY ====================")
    print(f"{'run':<26} {'rate':>8} {'queries/s':>10} {'avg ms':>7} {'p99 ms':>7} {'max ms':>7} {'lost':>5} "
          f"{'srv CPU %':>9} {'µs/q':>6} {'bg %':>5} {'core other %':>12} {'memo hit %':>10}")
    for run in runs:
        rate = f"-Q {run.fixed_qps}" if run.fixed_qps else f"max r{run.round}"
        p99 = f"{run.pct['p99']:.3f}" if run.pct else "-"
        hit = f"{100 * run.memo_hits / run.completed:.1f}" if run.memo_hits is not None and run.completed else "-"
        other = f"{run.server_core_other:.0f}" if run.server_core_other is not None else "-"
        print(f"{run.label:<26} {rate:>8} {run.qps:>10,.0f} {run.avg_ms:>7.3f} {p99:>7} {run.max_ms:>7.2f} "
              f"{run.lost:>5} {100 * run.server_cpu / args.duration:>9.0f} {run.us_per_query:>6.1f} "
              f"{run.background:>5.0f} {other:>12} {hit:>10}")
    pinned = "per core (server on its own core)" if not args.no_pin else "UNPINNED"
    print(f"\nratios of server µs per query, same shape, same round ({pinned}; lower is better):")
    by = {(r.round, r.shape, r.kind): r for r in runs if not r.fixed_qps and r.shape}
    out: dict[str, dict[str, Any]] = {}
    order = {shape: i for i, shape in enumerate(SHAPES)}
    for (rnd, shape, kind), run in sorted(by.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9), kv[0][2])):
        if not kind.startswith("agent") or not run.completed:
            continue
        for ref_kind in (REFERENCE.get(kind, "pdns-static"), "pdns-lua"):
            ref = by.get((rnd, shape, ref_kind))
            if ref is None or not ref.completed or not ref.us_per_query:
                continue
            value = run.us_per_query / ref.us_per_query
            goal = GOALS.get(kind) if ref_kind != "pdns-lua" else None
            verdict = f"  goal <= {goal:.1f}: {'met' if value <= goal else 'MISSED'}" if goal else ""
            name = f"{run.label} / {ref.label}"
            print(f"  round {rnd}: {name:<46} {run.us_per_query:>6.2f} / {ref.us_per_query:>6.2f} µs = "
                  f"{value:>5.2f}{verdict}")
            entry = out.setdefault(f"ratio {name}", {"shape": shape, "kind": kind, "reference": ref_kind,
                                                    "metric": "us_per_query", "values": [], "goal_at_most": goal})
            entry["values"].append(round(value, 3))
    for entry in out.values():
        entry["median"] = statistics.median(entry["values"])
        entry["met"] = entry["median"] <= entry["goal_at_most"] if entry["goal_at_most"] else None
    for run in runs:
        if run.fixed_qps and run.pct and run.label.startswith("agent"):
            verdict = "met" if run.pct["p99"] < 1.0 else "MISSED"
            print(f"  p99 at {run.fixed_qps} q/s, {run.label}: {run.pct['p99']:.3f} ms (goal < 1 ms: {verdict})")
    return out


if __name__ == "__main__":
    sys.exit(main())
