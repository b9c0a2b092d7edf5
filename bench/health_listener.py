"""Benchmark of the health listener: throughput with wrk, and p99 at a fixed request rate.

    python bench/health_listener.py                     # everything, ~1 minute
    python bench/health_listener.py --modes in-process --duration 5

For each mode the server runs pinned to CPU 0 and the load to CPU 1 (when there are two):

- ``bare``: a bare aiohttp + uvloop handler answering ``ok`` (the ceiling on this machine,
  measured in the same run so the numbers can be compared on a shared, noisy machine);
- ``in-process``: one process like the agent: the listener fed by a ``ViewHolder`` plus a
  ``FeedPublisher``, with a 10,000-copy view that changes ``--churn`` times a second;
- ``sidecar``: ``python -m health.sidecar`` on CPU 0, fed over the Unix socket by an
  agent-like process (publisher + churn) on CPU 1.

Load: ``wrk -t1 -c50 -d10s --latency`` against ``/global-health/<slug>`` (requests/s and
wrk's latency percentiles); then an open-loop fixed-rate generator (below: wrk has no rate
option and wrk2 is not packaged in Debian) at 1,000 requests/s for 10 s over 10 keep-alive
connections. It schedules request *i* at ``t0 + i/rate`` whatever happened before
(no coordinated omission) and reports latency both from the actual send and from the
scheduled time (the latter also counts the generator's own timer lateness).
Goals: >= 15,000 requests/s; p99 < 5 ms at 1,000 requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLUG = "p05001"
REGION = "sfo1"


# --- child roles -----------------------------------------------------------------------------


def _view(copies: int) -> object:
    from agent.state.local import CopyReason, CopyStatus, RegionView

    now = time.time()
    statuses = {}
    for i in range(copies):
        slug = f"p{i:05d}"
        healthy = i % 10 != 7  # SLUG (p05001) is healthy
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


async def _serve_bare(port: int) -> None:
    from aiohttp import web

    async def handler(request: web.BaseRequest) -> web.Response:
        return web.Response(text="ok")

    runner = web.ServerRunner(web.Server(handler, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def _serve_agent(port: int, mode: str, socket_path: Path, copies: int, churn: float) -> None:
    """Like the agent: a publisher, a view that changes, and (in-process) the listener."""
    import dataclasses

    from prometheus_client import CollectorRegistry

    from agent.state.local import CopyReason, CopyStatus, RegionView
    from health.service import HealthService
    from health.settings import HealthMode, HealthSettings

    settings = HealthSettings(
        mode=HealthMode(mode),
        listen_addresses=("127.0.0.1",),
        port=port,
        feed_socket=socket_path,
    )
    registry = CollectorRegistry()
    service = HealthService(settings, region=REGION, registry=registry)
    view = _view(copies)
    assert isinstance(view, RegionView)
    service.publish(view)
    if service.listener is not None:  # in-process: the agent also serves a (sidecar-less) feed
        from health.feed import FeedPublisher

        publisher = FeedPublisher(socket_path=socket_path, registry=registry)
        await publisher.start()
        publisher.publish(view)
    await service.start()
    generation = 0
    while True:
        await asyncio.sleep(1.0 / churn if churn > 0 else 3600)
        generation += 1
        slug = f"p{generation % copies:05d}"
        if slug == SLUG:
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
        if service.listener is not None:
            publisher.publish(view)


def _child(argv: list[str]) -> None:
    import uvloop

    role = argv[0]
    if role == "bare":
        uvloop.run(_serve_bare(int(argv[1])))
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


@dataclass
class Result:
    mode: str
    wrk_requests_per_second: float = 0.0
    wrk_latency_ms: dict[str, float] = field(default_factory=dict)
    wrk_non_2xx: int = 0
    fixed_rate: dict[str, object] = field(default_factory=dict)
    server_rss_mb: float = 0.0
    server_cpu_us_per_request: float = 0.0  # CPU time of the answering process / requests: robust to noise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(pid: int, cpu: int) -> None:
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(pid, {cpu})


@contextmanager
def _process(args: list[str], cpu: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
    _pin(proc.pid, cpu)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _wait_ready(port: int, path: str, proc: subprocess.Popen[bytes], deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)  # a bench, not a test: polling a child process for readiness
    raise RuntimeError(f"server on port {port} not ready within {deadline_s} s")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _wrk(port: int, path: str, duration: int, connections: int) -> tuple[float, dict[str, float], int, str]:
    command = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{duration}s",
        "--latency",
        f"http://127.0.0.1:{port}{path}",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    _pin(proc.pid, 1)
    out, _ = proc.communicate(timeout=duration + 30)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    latency: dict[str, float] = {}
    for pct, value, unit in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M):
        latency[f"p{pct}"] = round(float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit], 3)
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return rps, latency, int(non_2xx.group(1)) if non_2xx else 0, " ".join(command)


def _fixed_rate_in_child(port: int, path: str, rate: float, duration: float) -> dict[str, object]:
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "rate",
        str(port),
        path,
        str(rate),
        str(duration),
    ]
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    _pin(proc.pid, 1)
    out, _ = proc.communicate(timeout=duration + 60)
    return dict(json.loads(out))


def _measure(mode: str, opts: argparse.Namespace, tmp: Path) -> Result:
    port = _free_port()
    path = f"/global-health/{SLUG}"
    socket_path = tmp / f"{mode}.sock"
    python = sys.executable
    result = Result(mode)
    with contextlib.ExitStack() as stack:
        if mode == "bare":
            server = stack.enter_context(
                _process([python, __file__, "--child", "bare", str(port)], 0, tmp / "bare.log")
            )
            ready = path
        elif mode == "in-process":
            server = stack.enter_context(
                _process(
                    [
                        python,
                        __file__,
                        "--child",
                        "agent",
                        str(port),
                        "in-process",
                        str(socket_path),
                        str(opts.copies),
                        str(opts.churn),
                    ],
                    0,
                    tmp / "in-process.log",
                )
            )
            ready = "/readyz"
        else:
            stack.enter_context(
                _process(
                    [
                        python,
                        __file__,
                        "--child",
                        "agent",
                        "0",
                        "sidecar",
                        str(socket_path),
                        str(opts.copies),
                        str(opts.churn),
                    ],
                    1,
                    tmp / "agent.log",
                )
            )
            server = stack.enter_context(
                _process(
                    [
                        python,
                        "-m",
                        "health.sidecar",
                        "--region",
                        REGION,
                        "--feed-socket",
                        str(socket_path),
                        "--listen",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--log-level",
                        "warning",
                    ],
                    0,
                    tmp / "sidecar.log",
                )
            )
            ready = "/readyz"
        _wait_ready(port, ready, server)
        cpu_before = _cpu_seconds(server.pid)
        rps, latency, non_2xx, command = _wrk(port, path, opts.duration, opts.connections)
        cpu_used = _cpu_seconds(server.pid) - cpu_before
        result.server_cpu_us_per_request = round(cpu_used / (rps * opts.duration) * 1e6, 1)
        print(f"[{mode}] {command}", file=sys.stderr)
        result.wrk_requests_per_second, result.wrk_latency_ms, result.wrk_non_2xx = rps, latency, non_2xx
        result.fixed_rate = _fixed_rate_in_child(port, path, opts.rate, opts.rate_duration)
        result.server_rss_mb = _rss_mb(server.pid)
    return result


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="bare,in-process,sidecar")
    parser.add_argument("--duration", type=int, default=10, help="wrk seconds")
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--rate-duration", type=float, default=10.0)
    parser.add_argument("--copies", type=int, default=10_000)
    parser.add_argument("--churn", type=float, default=10.0, help="view changes per second")
    parser.add_argument("--json", type=Path, help="also write the results here")
    opts = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="health-bench-") as tmp:
        for mode in opts.modes.split(","):
            results.append(_measure(mode, opts, Path(tmp)))
    print(
        f"{'mode':<11} {'req/s':>9} {'p50':>7} {'p90':>7} {'p99':>7} {'non2xx':>6} | "
        f"{'rate':>6} {'p50':>7} {'p99':>7} {'p99.9':>7} {'p99*':>7} | {'RSS MB':>6} {'cpu us/req':>10}"
    )
    for r in results:
        fr = r.fixed_rate
        send = fr.get("from_send_ms", {})
        sched = fr.get("from_schedule_ms", {})
        assert isinstance(send, dict) and isinstance(sched, dict)
        print(
            f"{r.mode:<11} {r.wrk_requests_per_second:>9.0f} {r.wrk_latency_ms.get('p50', 0):>7.2f} "
            f"{r.wrk_latency_ms.get('p90', 0):>7.2f} {r.wrk_latency_ms.get('p99', 0):>7.2f} "
            f"{r.wrk_non_2xx:>6} | "
            f"{fr.get('achieved_rate', 0):>6} {send.get('p50', 0):>7.2f} {send.get('p99', 0):>7.2f} "
            f"{send.get('p99.9', 0):>7.2f} {sched.get('p99', 0):>7.2f} | {r.server_rss_mb:>6} "
            f"{r.server_cpu_us_per_request:>10}"
        )
    print("latencies in ms; p99* = p99 from the scheduled send time (includes the generator's lateness)")
    if opts.json:
        opts.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
