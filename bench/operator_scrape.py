"""DNS latency while clients scrape the operator listener (/metrics, /zone) in a loop.

    python bench/operator_scrape.py                    # 2,000 projects, 4 scrapers, 10 s a phase
    python bench/operator_scrape.py --smoke            # tiny, a second a phase: does it run?

One ``region-agent run`` (uvloop) serves a zone of ``--projects`` projects in two
regions, whose copies are a fake endpoint answering ``ok``. The checker starts every target at
once, so at 2,000 projects a round is a burst of 4,000 checks that takes the agent's loop seconds
(a checker matter, measured apart); ``--check-interval`` (300 s) keeps those bursts out of the
measured window so that what is measured is the listeners. An open-loop UDP client
sends ``--rate`` A queries a second for random projects (query *i* at ``t0 + i/rate``, whatever
happened before) and reports the latency of each answer from its send. Phases, ``--duration``
seconds each:

- ``idle``: DNS load only;
- ``scrape``: plus ``--scrapers`` clients looping ``GET /metrics`` and ``GET /zone`` on the
  operator listener as fast as they are answered (the default: /metrics rendered at most once a
  second in a worker thread, /zone once per zone generation);
- ``scrape-every-render``: the same with ``metrics_cache_seconds: 0`` (every scrape renders,
  in the thread), to show what the cache buys;
- ``scrape-public``: the scrapers on the public port instead, where both paths are 404.

The agent's loop thread and the DNS client run at ``--nice`` (-10, needs root) and the scrapers
at 19, so that on a shared machine the figures are the agent's and not other processes' turns.

Goal (issue 7): DNS p99 < 5 ms in ``scrape`` at 2,000 projects. Results: the JSON lines file
named at the end (``--out``), and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ZONE, Results, add_arguments, start_agent, wait_http
from dns_rig import Procs, free_port

PHASES = ("idle", "scrape", "scrape-every-render", "scrape-public")
COPY_HOSTS = ("127.0.0.11", "127.0.0.12")


def zone_yaml(projects: int) -> str:
    lines = ["regions:", "  sfo1: {ipv4: [127.0.0.11], ns_ipv4: [127.0.0.1]}",
             "  ams1: {ipv4: [127.0.0.12], ns_ipv4: [127.0.0.2]}", "projects:"]
    lines += [f"  p{i:05d}: {{regions: [sfo1, ams1], primary: sfo1}}" for i in range(projects)]
    return "\n".join(lines) + "\n"


# --- child roles ----------------------------------------------------------------------------------


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "p99.9": 0.0, "max": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {"p50": at(0.5), "p99": at(0.99), "p99.9": at(0.999), "max": round(ordered[-1] * 1000, 3)}


def dns_load(port: int, rate: float, duration: float, projects: int) -> dict[str, Any]:
    """Open-loop UDP A queries; latency from each actual send to its answer (matched by id)."""
    import dns.message

    rng = random.Random(7)
    wires = []
    for _ in range(2048):
        query = dns.message.make_query(f"p{rng.randrange(projects):05d}.{ZONE}", "A")
        query.id = 0
        wires.append(query.to_wire())
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    sent: dict[int, float] = {}
    latencies: list[float] = []
    start = time.perf_counter()
    end = start + duration
    i = 0
    while True:
        now = time.perf_counter()
        while i < rate * duration and start + i / rate <= now:
            qid = i & 0xFFFF
            wire = wires[i % len(wires)]
            sent[qid] = time.perf_counter()
            sock.send(qid.to_bytes(2, "big") + wire[2:])
            i += 1
        try:
            while True:
                data = sock.recv(4096)
                at = time.perf_counter()
                began = sent.pop(int.from_bytes(data[:2], "big"), None)
                if began is not None:
                    latencies.append(at - began)
        except BlockingIOError:
            pass
        if now > end + 1.0 or (now > end and not sent):
            break
        time.sleep(0.0002)
    return {"sent": i, "answered": len(latencies), "lost": i - len(latencies),
            "achieved_rate": round(i / duration), "latency_ms": _percentiles(latencies)}


def scrape(port: int, scrapers: int, duration: float) -> dict[str, Any]:
    import aiohttp

    counts = {"/metrics": 0, "/zone": 0}
    sizes = {"/metrics": 0, "/zone": 0}
    statuses: dict[int, int] = {}
    latencies: dict[str, list[float]] = {"/metrics": [], "/zone": []}

    async def one(http: aiohttp.ClientSession, end: float) -> None:
        while time.monotonic() < end:
            for path in ("/metrics", "/zone"):
                began = time.perf_counter()
                async with http.get(f"http://127.0.0.1:{port}{path}") as response:
                    body = await response.read()
                latencies[path].append(time.perf_counter() - began)
                statuses[response.status] = statuses.get(response.status, 0) + 1
                counts[path] += 1
                sizes[path] = len(body)

    async def run() -> None:
        end = time.monotonic() + duration
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(one(http, end) for _ in range(scrapers)))

    asyncio.run(run())
    return {"requests": counts, "per_second": {p: round(n / duration, 1) for p, n in counts.items()},
            "bytes": sizes, "statuses": {str(k): v for k, v in statuses.items()},
            "latency_ms": {p: _percentiles(v) for p, v in latencies.items()}}


def copies(port: int) -> None:
    """Every project's copy in both regions: ``ok`` to any request, with a backlog for the checks' bursts.

    (``region_agent/demo/fake_copy.py`` logs every check to a file and keeps asyncio's backlog of
    100: thousands of checks starting together overflow it and time out.)
    """
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    async def serve() -> None:
        servers = [await asyncio.start_server(handle, host, port, backlog=8192, reuse_address=True)
                   for host in COPY_HOSTS]
        print("listening", flush=True)
        await asyncio.gather(*(server.serve_forever() for server in servers))

    asyncio.run(serve())


def _child(argv: list[str]) -> None:
    role, *args = argv
    if role == "copies":
        copies(int(args[0]))
    elif role == "dns":
        port, rate, duration, projects = int(args[0]), float(args[1]), float(args[2]), int(args[3])
        print(json.dumps(dns_load(port, rate, duration, projects)))
    else:
        port, scrapers, duration = int(args[0]), int(args[1]), float(args[2])
        print(json.dumps(scrape(port, scrapers, duration)))


def _spawn(*args: object, nice: int = 0, pin: bool = False) -> subprocess.Popen[str]:
    # The scrapers are niced so that the DNS client is never starved by them: its latencies
    # are the agent's, not its own queueing. With --pin, CPU 1 for the load, CPU 0 for the agent.
    taskset = ["taskset", "-c", "1"] if pin else []
    return subprocess.Popen([*taskset, "nice", "-n", str(nice), sys.executable, __file__, "--child",
                             *map(str, args)], stdout=subprocess.PIPE, text=True)


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def _series(port: int) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return sum(1 for line in response.read().decode().splitlines() if line and not line.startswith("#"))


def measure(procs: Any, phase: str, opts: argparse.Namespace) -> dict[str, Any]:
    env = {"REGION_AGENT_HEALTH__METRICS_CACHE_SECONDS": "0"} if phase == "scrape-every-render" else {}
    port = free_port(COPY_HOSTS, udp=False)
    endpoint, endpoint_log = procs.start(f"copies-{phase}", [sys.executable, __file__, "--child", "copies", str(port)])
    deadline = time.monotonic() + 15
    while "listening" not in endpoint_log.read_text():
        if endpoint.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the fake copies did not start: {endpoint_log.read_text()[-1000:]}")
        time.sleep(0.05)
    agent = start_agent(procs, f"agent-{phase}", zone_yaml(opts.projects),
                        checks={"port": port, "interval": opts.check_interval, "timeout": 10}, env=env, wait="dns")
    operator = agent.metrics_port  # common.start_agent: the operator listener
    assert operator is not None
    # The first check round of thousands of targets takes the agent tens of seconds.
    wait_http(operator, "/readyz", [(agent.proc, agent.log)], timeout=180)
    if opts.pin:
        subprocess.run(["taskset", "-a", "-p", "-c", "0", str(agent.pid)], check=True, capture_output=True)
    os.setpriority(os.PRIO_PROCESS, agent.pid, opts.nice)  # its event loop's thread
    scrape_port = _public_port(agent) if phase == "scrape-public" else operator
    try:
        time.sleep(opts.settle)  # let the first check rounds and compile settle (a bench, not a test)
        series = _series(operator)
        cpu0 = _cpu(agent.pid)
        scrapers = (_spawn("scrape", scrape_port, opts.scrapers, opts.duration, nice=19, pin=opts.pin)
                    if phase != "idle" else None)
        load = _spawn("dns", agent.port, opts.rate, opts.duration, opts.projects, nice=opts.nice, pin=opts.pin)
        dns_out, _ = load.communicate(timeout=opts.duration + 60)
        scrape_out = json.loads(scrapers.communicate(timeout=opts.duration + 60)[0]) if scrapers else None
        cpu = _cpu(agent.pid) - cpu0
    finally:
        procs.stop(agent.proc)
        procs.stop(endpoint)
    return {"phase": phase, "projects": opts.projects, "series": series, "dns": json.loads(dns_out),
            "scrape": scrape_out, "agent_cpu_percent": round(100 * cpu / opts.duration, 1)}


def _public_port(agent: Any) -> int:
    import yaml

    # The config common.start_agent wrote for this agent.
    config = yaml.safe_load((agent.log.parent / agent.name / "agent.yaml").read_text())
    return int(config["health"]["port"])


def _table(results: list[dict[str, Any]]) -> None:
    print(f"{'phase':<20} {'series':>6} {'qps':>5} {'lost':>5} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7} | "
          f"{'metrics/s':>9} {'zone/s':>7} {'metrics p99':>11} | {'agent cpu%':>10}")
    for r in results:
        lat = r["dns"]["latency_ms"]
        s = r["scrape"] or {"per_second": {"/metrics": 0, "/zone": 0}, "latency_ms": {"/metrics": {"p99": 0}}}
        print(f"{r['phase']:<20} {r['series']:>6} {r['dns']['achieved_rate']:>5} {r['dns']['lost']:>5} "
              f"{lat['p50']:>7.3f} {lat['p99']:>7.3f} {lat['p99.9']:>7.3f} {lat['max']:>7.3f} | "
              f"{s['per_second']['/metrics']:>9} {s['per_second']['/zone']:>7} "
              f"{s['latency_ms']['/metrics']['p99']:>11.1f} | {r['agent_cpu_percent']:>10}")
    print("DNS latencies in ms from each query's send; scrapes/s over all scrapers")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--projects", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=2000.0, help="DNS queries per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per phase")
    parser.add_argument("--scrapers", type=int, default=4)
    parser.add_argument("--settle", type=float, default=6.0, help="seconds after ready before measuring")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--pin", action="store_true",
                        help="agent on CPU 0, load on CPU 1 (on a machine shared with other work this makes "
                        "things worse: pinned processes can not move away from a busy core)")
    parser.add_argument("--nice", type=int, default=-10,
                        help="niceness of the agent's loop thread and of the DNS client (the scrapers run at 19): "
                        "on a shared machine, other people's work would otherwise be what is measured")
    parser.add_argument("--check-interval", type=float, default=300.0,
                        help="seconds between checks of a copy (the default keeps the checker's bursts out "
                        "of the window: this bench measures the listeners)")
    add_arguments(parser)
    opts = parser.parse_args()
    phases = opts.phases.split(",")
    if not set(phases) <= set(PHASES) or not 0 < opts.duration <= 600:
        parser.error(f"--phases from {','.join(PHASES)}; --duration 0..600 s")
    if opts.smoke:
        opts.projects, opts.duration, opts.rate, opts.settle = 50, 1.0, 200.0, 0.5
    results = []
    with Results("operator_scrape", opts.out, smoke=opts.smoke) as out, \
            tempfile.TemporaryDirectory(prefix="operator-scrape-") as tmp, Procs(Path(tmp)) as procs:
        for phase in phases:
            result = measure(procs, phase, opts)
            out.add(phase, **result)
            results.append(result)
        _table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
