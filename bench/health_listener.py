"""Benchmark of the health listener: throughput with wrk, and p99 at a fixed request rate.

    python bench/health_listener.py                     # every mode, ~1 minute
    python bench/health_listener.py --modes in-process --duration 5
    python bench/health_listener.py --smoke             # every mode for a second: does it run?

For each mode the server runs pinned to CPU 0 and the load to CPU 1 (when there are two):

- ``bare``: a bare aiohttp + uvloop handler answering ``ok`` on aiohttp's low-level ``web.Server``
  as the listener uses it (the ceiling on this machine, measured in the same run so the numbers
  can be compared on a shared, noisy machine);
- ``bare-app``: the same handler behind an ``Application`` with one route (router, middlewares,
  signals): what the low-level server saves;
- ``in-process``: one process like the agent: a ``HealthService`` in in-process mode (the
  listener answering from its ``ViewHolder``) with a 10,000-copy view that changes ``--churn``
  times a second;
- ``sidecar``: ``python -m region_agent.health.sidecar`` on CPU 0, fed over the Unix socket by an agent-like
  process on CPU 1 (a ``HealthService`` in sidecar mode: the ``FeedPublisher`` plus the agent's
  own listener on a free ``agent_port``, churning the same way).

Load: ``wrk -t1 -c50 -d10s --latency`` against ``/global-health/<slug>`` (requests/s and
wrk's latency percentiles); then an open-loop fixed-rate generator (below: wrk has no rate
option and wrk2 is not packaged in Debian) at 1,000 requests/s for 10 s over 10 keep-alive
connections. It schedules request *i* at ``t0 + i/rate`` whatever happened before
(no coordinated omission) and reports latency both from the actual send and from the
scheduled time (the latter also counts the generator's own timer lateness).
Goals: >= 15,000 requests/s; p99 < 5 ms at 1,000 requests/s. Results: ``bench/README.md``;
every run writes its raw results to the JSON lines file it names at the end (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, Foreign, Results, add_arguments, run_wrk, wait_http
from dns_rig import Procs, cpu_seconds, free_port, need_tools

MODES = ("bare", "bare-app", "in-process", "sidecar")


def _slug(copies: int) -> str:
    """The copy every request asks for: in the middle of the view, healthy, never flipped by the churn."""
    return f"p{copies // 2 + 1:05d}"

REGION = "sfo1"


# --- child roles -----------------------------------------------------------------------------


def _view(copies: int) -> object:
    from region_agent.state.local import CopyReason, CopyStatus, RegionView

    now = time.time()
    statuses = {}
    for i in range(copies):
        slug = f"p{i:05d}"
        healthy = i % 10 != 7 or slug == _slug(copies)  # one in ten down, never the one asked for
        statuses[slug] = CopyStatus(
            slug=slug,
            healthy=healthy,
            reason=CopyReason.OK if healthy else CopyReason.NO_READY_REVISION,
            namespace=f"proj-{slug}",
            service=slug,
            revisions=(f"{slug}-00001",),
        )
    return RegionView(
        region=REGION,
        started_at=now,
        generated_at=now,
        synced=True,
        synced_at=now,
        copies=statuses,
        zone_serial=1,
        zone_digest="0" * 16,
    )


async def _serve_bare(port: int, app: bool) -> None:
    """``ok`` from aiohttp's low-level ``web.Server`` (what the listener is built on) or, with ``app``,
    from an ``Application`` with one route (router, middlewares and signals on every request)."""
    from aiohttp import web

    async def handler(request: web.BaseRequest) -> web.Response:
        return web.Response(text="ok")

    if app:
        application = web.Application()
        application.router.add_get("/global-health/{slug}", handler)
        runner: web.BaseRunner = web.AppRunner(application, access_log=None)
    else:
        runner = web.ServerRunner(web.Server(handler, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def _serve_agent(port: int, mode: str, socket_path: Path, copies: int, churn: float) -> None:
    """Like the agent: a ``HealthService`` in the given mode, fed a view that changes ``churn``/s."""
    import dataclasses

    from prometheus_client import CollectorRegistry

    from region_agent.health.service import HealthService
    from region_agent.health.settings import HealthMode, HealthSettings
    from region_agent.state.local import CopyReason, CopyStatus, RegionView

    # The agent's operator listener on a free port (in sidecar mode the sidecar owns `port`).
    settings = HealthSettings(
        mode=HealthMode(mode),
        listen_addresses=("127.0.0.1",),
        port=port,
        feed_socket=socket_path,
        operator_port=0,
    )
    from region_agent.base.tracing import start_from_env

    # Spans exported when the OTEL_* environment says so, as in the agent (off otherwise): run the bench
    # with OTEL_EXPORTER_OTLP_ENDPOINT set to measure tracing on.
    start_from_env(region=REGION, node="bench", version="bench")
    service = HealthService(settings, region=REGION, registry=CollectorRegistry())
    view = _view(copies)
    assert isinstance(view, RegionView)
    service.publish(view)
    await service.start()
    generation = 0
    while True:
        await asyncio.sleep(1.0 / churn if churn > 0 else 3600)
        generation += 1
        slug = f"p{generation % copies:05d}"
        if slug == _slug(copies):
            continue
        old = view.copies[slug]
        flipped = CopyStatus(
            slug=slug,
            healthy=not old.healthy,
            reason=CopyReason.NO_READY_REVISION if old.healthy else CopyReason.OK,
            namespace=old.namespace,
            service=old.service,
            revisions=old.revisions,
        )
        view = dataclasses.replace(view, copies={**view.copies, slug: flipped}, generated_at=time.time())
        service.publish(view)


def _child(argv: list[str]) -> None:
    import uvloop

    role = argv[0]
    if role in ("bare", "bare-app"):
        uvloop.run(_serve_bare(int(argv[1]), app=role == "bare-app"))
    elif role == "agent":
        uvloop.run(_serve_agent(int(argv[1]), argv[2], Path(argv[3]), int(argv[4]), float(argv[5])))
    elif role == "rate":
        print(json.dumps(uvloop.run(_fixed_rate(int(argv[1]), argv[2], float(argv[3]), float(argv[4]), 10))))


# --- the fixed-rate load generator ------------------------------------------------------------


async def _fixed_rate(
    port: int, path: str, rate: float, duration: float, connections: int
) -> dict[str, object]:
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    for _ in range(connections):
        idle.put_nowait(await asyncio.open_connection("127.0.0.1", port))
    loop = asyncio.get_running_loop()
    from_send: list[float] = []
    from_schedule: list[float] = []
    statuses: dict[int, int] = {}

    async def one(scheduled: float) -> None:
        reader, writer = await idle.get()
        sent = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        await reader.readexactly(length)
        done = time.perf_counter()
        idle.put_nowait((reader, writer))
        from_send.append(done - sent)
        from_schedule.append(done - scheduled)
        statuses[status] = statuses.get(status, 0) + 1

    total = int(rate * duration)
    start = time.perf_counter() + 0.05
    tasks: set[asyncio.Task[None]] = set()
    i = 0
    while i < total:
        now = time.perf_counter()
        while i < total and start + i / rate <= now:  # send everything that is due, even if late
            task = loop.create_task(one(start + i / rate))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if i < total:
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    elapsed = time.perf_counter() - start

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {
        "requests": total,
        "achieved_rate": round(total / elapsed, 1),
        "statuses": statuses,
        "from_send_ms": {f"p{int(q * 1000) / 10:g}": pct(from_send, q) for q in (0.5, 0.9, 0.99, 0.999)}
        | {"max": round(max(from_send) * 1000, 3)},
        "from_schedule_ms": {
            f"p{int(q * 1000) / 10:g}": pct(from_schedule, q) for q in (0.5, 0.9, 0.99, 0.999)
        }
        | {"max": round(max(from_schedule) * 1000, 3)},
    }


# --- the driver ---------------------------------------------------------------------------------


def _pin(pid: int, cpu: int) -> None:
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(pid, {cpu})


def _start(procs: Procs, name: str, argv: list[str], cpu: int) -> tuple[subprocess.Popen[bytes], Path]:
    proc, log = procs.start(name, [sys.executable, *argv], env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    _pin(proc.pid, cpu)
    return proc, log


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _fixed_rate_in_child(port: int, path: str, rate: float, duration: float) -> dict[str, Any]:
    args = [sys.executable, str(Path(__file__).resolve()), "--child", "rate", str(port), path, str(rate),
            str(duration)]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    _pin(proc.pid, 1)
    try:
        out, _ = proc.communicate(timeout=duration + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    if proc.returncode != 0:
        raise RuntimeError(f"fixed-rate generator exited with {proc.returncode}")
    return dict(json.loads(out))


def _start_server(procs: Procs, mode: str, port: int, opts: argparse.Namespace,
                  tmp: Path) -> tuple[list[tuple[subprocess.Popen[bytes], Path]], str]:
    """The processes of ``mode`` (the one answering on ``port`` first) and the path that says it is ready."""
    me = str(Path(__file__).resolve())
    view = [str(tmp / f"{mode}.sock"), str(opts.copies), str(opts.churn)]
    if mode in ("bare", "bare-app"):
        return [_start(procs, mode, [me, "--child", mode, str(port)], 0)], f"/global-health/{_slug(opts.copies)}"
    if mode == "in-process":
        return [_start(procs, "in-process", [me, "--child", "agent", str(port), "in-process", *view], 0)], "/readyz"
    # sidecar: the feeding agent on the load's core, the sidecar alone on the server's core
    agent = _start(procs, "sidecar-agent", [me, "--child", "agent", "0", "sidecar", *view], 1)
    sidecar = _start(procs, "sidecar", ["-m", "region_agent.health.sidecar", "--region", REGION,
                                        "--feed-socket", view[0],
                                        "--listen", "127.0.0.1", "--port", str(port), "--operator-port", "0",
                                        "--log-level", "warning"], 0)
    return [sidecar, agent], "/readyz"


def _measure(procs: Procs, mode: str, opts: argparse.Namespace) -> dict[str, Any]:
    port = free_port(udp=False)
    path = f"/global-health/{_slug(opts.copies)}"
    try:
        watch, ready = _start_server(procs, mode, port, opts, procs.tmp)
        wait_http(port, ready, watch)
        server = watch[0][0]
        cpu_before = cpu_seconds(server.pid)
        with Foreign([proc.pid for proc, _ in watch]) as foreign:
            wrk = run_wrk(f"http://127.0.0.1:{port}{path}", duration=opts.duration, connections=opts.connections,
                          cpu=1)
        cpu_used = cpu_seconds(server.pid) - cpu_before
        print(f"[{mode}] {wrk['command']}", file=sys.stderr)
        fixed_rate = _fixed_rate_in_child(port, path, opts.rate, opts.rate_duration)
        return {
            "mode": mode,
            "copies": 0 if mode.startswith("bare") else opts.copies,
            "churn_per_second": 0 if mode.startswith("bare") else opts.churn,
            "wrk": wrk,
            "wrk_foreign_busy_percent": foreign.percent,  # other people's load on both cores during wrk
            "fixed_rate": fixed_rate,
            "server_rss_mb": _rss_mb(server.pid),
            # CPU time of the answering process per request: steadier than req/s on a shared machine
            "server_cpu_us_per_request": round(cpu_used / max(1, wrk["requests"]) * 1e6, 1),
        }
    finally:
        procs.stop_all()  # one mode at a time on the machine


def _table(results: list[dict[str, Any]]) -> None:
    print(
        f"{'mode':<11} {'req/s':>9} {'p50':>7} {'p90':>7} {'p99':>7} {'non2xx':>6} | "
        f"{'rate':>6} {'p50':>7} {'p99':>7} {'p99.9':>7} {'p99*':>7} | {'RSS MB':>6} {'cpu us/req':>10} {'bg %':>5}"
    )
    for r in results:
        wrk, fr = r["wrk"], r["fixed_rate"]
        lat, send, sched = wrk["latency_ms"], fr["from_send_ms"], fr["from_schedule_ms"]
        print(
            f"{r['mode']:<11} {wrk['requests_per_second']:>9.0f} {lat.get('p50', 0):>7.2f} "
            f"{lat.get('p90', 0):>7.2f} {lat.get('p99', 0):>7.2f} {wrk['non_2xx']:>6} | "
            f"{fr['achieved_rate']:>6} {send['p50']:>7.2f} {send['p99']:>7.2f} "
            f"{send['p99.9']:>7.2f} {sched['p99']:>7.2f} | {r['server_rss_mb']:>6} "
            f"{r['server_cpu_us_per_request']:>10} {r['wrk_foreign_busy_percent']:>5.0f}"
        )
    print("latencies in ms; p99* = p99 from the scheduled send time (includes the generator's lateness); "
          "bg % = other processes' load on both cores during wrk")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--duration", type=int, default=10, help="wrk seconds")
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--rate-duration", type=float, default=10.0)
    parser.add_argument("--copies", type=int, default=10_000)
    parser.add_argument("--churn", type=float, default=10.0, help="view changes per second")
    add_arguments(parser)
    opts = parser.parse_args()
    modes = opts.modes.split(",")
    if not set(modes) <= set(MODES) or not 1 <= opts.duration <= 600 or not 0 < opts.rate_duration <= 600:
        parser.error(f"--modes from {','.join(MODES)}; --duration and --rate-duration 1..600 s")
    if opts.smoke:  # every mode and both load generators, for a second each
        modes = list(MODES)
        opts.duration, opts.rate, opts.rate_duration, opts.copies, opts.connections = 1, 200.0, 1.0, 200, 10
    need_tools("wrk")
    results: list[dict[str, Any]] = []
    with Results("health_listener", opts.out, smoke=opts.smoke, tools=("wrk",)) as out, \
            tempfile.TemporaryDirectory(prefix="health-bench-") as tmp, Procs(Path(tmp)) as procs:
        for mode in modes:
            result = _measure(procs, mode, opts)
            out.add(mode, **result)
            results.append(result)
        bare = next((r for r in results if r["mode"] == "bare"), None)
        if bare is not None:
            ceiling = bare["wrk"]["requests_per_second"]
            out.add("ratios", of_bare_requests_per_second={
                r["mode"]: round(r["wrk"]["requests_per_second"] / ceiling, 3) for r in results if ceiling > 0})
        _table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
