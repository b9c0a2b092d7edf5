"""Longest event-loop stall while the zone changes: a reload of many projects, a full recompile.

A probe task sleeps 1 ms in a loop and records the longest gap between its wake-ups (minus
the 1 ms it asked for): that is the longest time nothing else on the loop, a DNS answer
included, could run. Scenarios, each through the real ``ZoneFileWatcher`` + ``Store`` +
``ZoneService`` (DNS server bound on 127.0.0.1, a free port) and the real zone file:

* ``reload``: a file of N projects is rewritten with M of them changed (their regions); the
  watcher notices on its poll, settles, reads and parses off the loop, applies one batch,
  and the zone service recompiles the changed projects;
* ``recompile``: one region's address changes in the file, so every project is compiled
  again (the same full compilation a GeoIP change causes).

Each is repeated; the stall is measured from the file write until the new tables are in
place. While the compile runs, a DNS query sent every 5 ms is answered (from the previous
tables) and its worst latency reported too.

    python bench/loop_stall.py                 # 10,000 projects, 1,000 changed, 5 repeats
    python bench/loop_stall.py --smoke         # tiny sizes, seconds
    python bench/loop_stall.py --workers 2     # dns.workers=2: worker processes answer, the main loop feeds them
    python bench/loop_stall.py --out bench/results/loop_stall-<date>.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Results, add_arguments
from prometheus_client import CollectorRegistry

from region_agent.globaldns.service import ZoneService
from region_agent.globaldns.settings import DnsSettings
from region_agent.state.hlc import HybridClock
from region_agent.state.store import Store
from region_agent.zonefile.watcher import ZoneFileWatcher

REGIONS = ("sfo1", "ams1", "nrt1", "iad1")
ZONE = "g.example.com"


def zone_text(projects: int, changed: int, round_: int, region_octet: int = 11) -> str:
    """N projects; the first ``changed`` get regions that depend on the round (so each round changes them)."""
    lines = ["regions:"]
    for i, name in enumerate(REGIONS):
        octet = region_octet if i == 0 else 11 + i
        lines.append(f"  {name}: {{ipv4: [192.0.2.{octet}], ns_ipv4: [192.0.2.{50 + i}]}}")
    lines.append("projects:")
    for n in range(projects):
        if n < changed:
            a, b = REGIONS[round_ % 4], REGIONS[(round_ + 1) % 4]
        else:
            a, b = REGIONS[n % 4], REGIONS[(n + 1) % 4]
        lines.append(f"  p{n}: {{regions: [{a}, {b}], primary: {a}}}")
    return "\n".join(lines) + "\n"


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class StallProbe:
    """Sleeps ``interval`` in a loop; ``worst`` is the longest overshoot of a wake-up.

    ``worst_cpu`` is the most CPU time the loop's thread used between two wake-ups: the
    part of a stall that is our code running, as opposed to the thread waiting for a core
    (on a loaded machine) or for the GIL (while the read thread parses).
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.worst = 0.0
        self.worst_cpu = 0.0
        self.wakeups = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(self.interval)
            now, cpu = time.perf_counter(), time.thread_time()
            self.worst = max(self.worst, now - last - self.interval)
            self.worst_cpu = max(self.worst_cpu, cpu - last_cpu)
            self.wakeups += 1
            last, last_cpu = now, cpu

    def start(self) -> None:
        self.worst, self.worst_cpu, self.wakeups = 0.0, 0.0, 0
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class QueryProbe(asyncio.DatagramProtocol):
    """Sends a query for p0 every ``interval`` and records the worst answer latency."""

    def __init__(self) -> None:
        self.sent: dict[int, float] = {}
        self.worst = 0.0
        self.answered = 0
        self.rcodes: dict[int, int] = {}

    def datagram_received(self, data: bytes, addr: Any) -> None:
        sent = self.sent.pop(int.from_bytes(data[:2], "big"), None)
        if sent is not None:
            self.worst = max(self.worst, time.perf_counter() - sent)
            self.answered += 1
            rcode = data[3] & 0x0F
            self.rcodes[rcode] = self.rcodes.get(rcode, 0) + 1


def _query(qid: int) -> bytes:
    name = b"".join(bytes([len(label)]) + label.encode() for label in f"p0.{ZONE}".split(".")) + b"\x00"
    return qid.to_bytes(2, "big") + b"\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00" + name + b"\x00\x01\x00\x01"


async def run_scenario(name: str, watcher: ZoneFileWatcher, zone: ZoneService, text: str, port: int,
                       timeout: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    transport, queries = await loop.create_datagram_endpoint(QueryProbe, remote_addr=("127.0.0.1", port))
    probe = StallProbe()
    before = zone.tables
    zone.changed.clear()
    probe.start()
    started = time.perf_counter()
    # The writer is another process in real life: its work must not count as the loop's.
    await asyncio.to_thread(write_atomically, watcher.path, text)
    qid = 0
    try:
        deadline = started + timeout
        # At least one query: on a busy machine the file can be applied before this loop starts.
        while qid == 0 or zone.tables is before or _compiling(zone) or not _workers_in_step(zone):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{name}: zone not recompiled within {timeout} s")
            qid = (qid + 1) & 0xFFFF
            queries.sent[qid] = time.perf_counter()
            transport.sendto(_query(qid))
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        await asyncio.sleep(0.05)  # the last answers
    finally:
        await probe.stop()
        transport.close()
    return {"type": "result", "name": name, "longest_stall_ms": round(probe.worst * 1000, 2),
            "longest_busy_cpu_ms": round(probe.worst_cpu * 1000, 2),
            "wakeups": probe.wakeups, "seconds_to_new_tables": round(elapsed, 3),
            "queries_sent": qid, "queries_answered": queries.answered,
            "worst_query_ms": round(queries.worst * 1000, 2), "rcodes": queries.rcodes}


def _workers_in_step(zone: ZoneService) -> bool:
    """With dns.workers: every worker has confirmed the newest tables (the feed is part of the change)."""
    return zone.workers is None or zone.workers.in_step()


def _compiling(zone: ZoneService) -> bool:
    """Whether a compilation is pending or running."""
    return zone._pending is not None


async def bench(args: argparse.Namespace, out: Results) -> list[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="loop-stall-"))
    path = tmp / "zone.yaml"
    path.write_text(zone_text(args.projects, args.changed, 0))
    store = Store(writer="standalone/bench", clock=HybridClock(lambda: int(time.time() * 1000)))
    registry = CollectorRegistry()
    watcher = ZoneFileWatcher(path, store, registry, poll_interval=0.05, settle=0.05)
    zone = ZoneService(DnsSettings(zone=ZONE, listen_addresses=("127.0.0.1",), port=0, workers=args.workers),
                       store, registry)
    await watcher.load()
    zone.set_health_known()
    await zone.start()
    port = int(zone.server.bound[0][1])
    await zone.compiled()
    while not _workers_in_step(zone):  # noqa: ASYNC110 - polling a condition of other processes
        await asyncio.sleep(0.01)
    gc.freeze()  # as the agent does after start-up (region_agent/app/supervisor.py)
    task = asyncio.get_running_loop().create_task(watcher.run())
    results = []
    try:
        for repeat in range(args.repeats):
            text = zone_text(args.projects, args.changed, repeat + 1)
            result = await run_scenario("reload", watcher, zone, text, port, args.timeout)
            results.append({**result, "repeat": repeat, "projects": args.projects, "changed": args.changed,
                            "workers": args.workers})
            text = zone_text(args.projects, args.changed, repeat + 1, region_octet=100 + repeat)
            result = await run_scenario("recompile", watcher, zone, text, port, args.timeout)
            results.append({**result, "repeat": repeat, "projects": args.projects, "changed": args.projects,
                            "workers": args.workers})
        for result in results:
            out.add(**{k: v for k, v in result.items() if k != "type"})
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await zone.stop()
        shutil.rmtree(tmp)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--projects", type=int, default=10_000)
    parser.add_argument("--changed", type=int, default=1_000, help="projects changed by the reload")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one scenario may take")
    parser.add_argument("--workers", type=int, default=1, help="dns.workers (1: the loop answers DNS itself)")
    add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.projects, args.changed, args.repeats = 200, 20, 1
    logging.basicConfig(level=logging.WARNING)
    runner: Callable[[Coroutine[Any, Any, list[dict[str, Any]]]], list[dict[str, Any]]] = asyncio.run
    with contextlib.suppress(ImportError):  # the agent runs on uvloop where it is installed
        import uvloop

        runner = uvloop.run
    with Results("loop_stall", args.out, smoke=args.smoke) as out:
        results = runner(bench(args, out))
    print(f"{args.projects} projects, reload changes {args.changed}; {args.repeats} repeats; "
          f"dns.workers {args.workers}; "
          f"load {os.getloadavg()[0]:.2f} at the end")
    for name in ("reload", "recompile"):
        rows = [r for r in results if r["name"] == name]
        stalls = sorted(r["longest_stall_ms"] for r in rows)
        busy = sorted(r["longest_busy_cpu_ms"] for r in rows)
        print(f"{name:<10} longest stall {stalls[-1]:8.1f} ms (median of repeats {stalls[len(stalls) // 2]:.1f}), "
              f"of which loop CPU {busy[-1]:.1f} ms (median {busy[len(busy) // 2]:.1f}); "
              f"new tables after {max(r['seconds_to_new_tables'] for r in rows):.2f} s; worst DNS answer "
              f"{max(r['worst_query_ms'] for r in rows):.1f} ms; "
              f"unanswered {sum(r['queries_sent'] - r['queries_answered'] for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
