"""Usage metering under pod churn: the agent's CPU per simulated minute, spool and reporter throughput.

Goal (issue 4): with 1,000 project pods churning per minute on the node, the agent's usage path
costs under 5% of one core.

Three processes (spawned, so the measured one never loads the fakes):

* **kube**: the fake apiserver plus a churn driver. Every pod lives a full lifecycle — ADDED
  Pending, MODIFIED Running, MODIFIED with a deletionTimestamp, MODIFIED terminated, DELETED —
  so five watch events per pod, each a realistic ~5 KiB object (managedFields padding). Lifetimes
  are uniform around ``resident / rate`` so ``resident`` pods run at any moment.
* **control plane**: the fake usage endpoint (always answers 200).
* **agent** (this process, measured): the real pod informer over kubernetes_asyncio → the usage
  service → SQLite spool (WAL, synchronous=FULL, on the temp dir's filesystem) → reporter.

Time can be compressed by ``--speed``: every process maps real time to simulated time the same
way, pod timestamps are simulated seconds and so are the agent's checkpoint and report intervals.
CPU is ``time.process_time()`` of the agent process (event loop, the spool's worker thread,
everything), measured from the first pod to the end of the churn, and reported per simulated
minute; the backlog flush afterwards is reported separately. **Compression flatters the result**:
events that arrive 20x closer together share watch reads, loop wake-ups and SQLite transactions,
so ``--speed 20`` shows well under the per-minute CPU that real time costs (``bench/README.md``
has both). The goal is checked at ``--speed 1`` (the default); use compression for quick runs and
for correctness under load (billed vs true pod-seconds).

Run from the repository root::

    python bench/usage_churn.py                         # the goal: 1,000 pods/min, 3 minutes in real time
    python bench/usage_churn.py --minutes 10 --speed 20 # quick: 10 simulated minutes in ~30 s
    python bench/usage_churn.py --pods-per-minute 2000 --resident 200 --minutes 2
    python bench/usage_churn.py --smoke                 # half a simulated minute at x30: does it run?

Results: ``bench/README.md``; every run writes its raw results to the JSON lines file it names at
the end (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import importlib
import multiprocessing
import multiprocessing.synchronize
import os
import random
import resource
import sys
import tempfile
import threading
import time
from multiprocessing.queues import Queue
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Foreign, Results, add_arguments

# The fake processes are spawned and import this module again: the agent's side is imported where
# it is used, so they start in a fraction of the time (and never load it).
if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

NODE = "node-a"
CLK_TCK = os.sysconf("SC_CLK_TCK")
BASE_WALL = 1_900_000_000.0  # simulated epoch of the run's start


class ScaledClock:
    """Simulated time = BASE_WALL + (real time since ``start``) x ``speed``; sleeps shrink accordingly."""

    def __init__(self, start: float, speed: float) -> None:
        self.start = start
        self.speed = speed

    def wall(self) -> float:
        return BASE_WALL + (time.time() - self.start) * self.speed

    def monotonic(self) -> float:
        return self.wall()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.speed)

    async def until(self, sim_wall: float) -> None:
        await asyncio.sleep(max(0.0, (sim_wall - self.wall()) / self.speed))


def churn_process(args: argparse.Namespace, starts: Queue[float], urls: Queue[Any], results: Queue[Any],
                  stop: multiprocessing.synchronize.Event) -> None:
    """The fake apiserver and the pods' lifecycles (imported here: the agent process never loads them)."""
    from region_agent.kube.resources import PODS
    from tests.fakes.kube_api import FakeKubeApi
    from tests.usage.factory import down, pod, up

    padding = {"managedFields": [{"manager": "kubelet", "operation": "Update",
                                  "fieldsV1": {"f:status": {"f:x": "y" * 3500}}}]}

    def with_padding(obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"].update(padding)
        return obj

    async def main() -> None:
        fake = FakeKubeApi()
        urls.put(await fake.start())
        # the start instant comes once every process is up: spawning may take seconds on a busy machine
        clock = ScaledClock(await asyncio.to_thread(starts.get, True, 120), args.speed)
        rng = random.Random(1)
        mean_life = 60.0 * args.resident / args.pods_per_minute
        interval = 60.0 / args.pods_per_minute
        end_of_churn = BASE_WALL + args.minutes * 60
        # (sim time, seq, action, name, started_at) — one heap of everything that will happen
        plan: list[tuple[float, int, str, str, int]] = []
        seq = 0
        t = BASE_WALL
        while t < end_of_churn:
            seq += 1
            life = rng.uniform(0.5, 1.5) * mean_life
            name = f"pod-{seq:06d}"
            heapq.heappush(plan, (t, seq, "create", name, 0))
            heapq.heappush(plan, (t + 1, seq, "run", name, 0))
            heapq.heappush(plan, (t + 1 + life, seq, "terminate", name, 0))
            t += interval
        truth = 0
        started: dict[str, int] = {}
        events = 0
        while plan:
            when, seq, action, name, _ = heapq.heappop(plan)
            await clock.until(when)
            now = int(clock.wall())
            if action == "create":
                fake.put(PODS, with_padding(pod(name, uid=name, node=NODE, phase="Pending", statuses=None)))
                events += 1
            elif action == "run":
                started[name] = now
                fake.put(PODS, with_padding(up(now, name=name, uid=name, node=NODE)))
                events += 1
            elif action == "terminate":
                begun = started.pop(name)
                fake.put(PODS, with_padding(up(begun, name=name, uid=name, node=NODE, deletion=now + 30)))
                fake.put(PODS, with_padding(down(now, name=name, uid=name, node=NODE, phase="Running",
                                                 deletion=now + 30)))
                fake.delete(PODS, "shop", name)
                truth += now - begun
                events += 3
        results.put({"truth_seconds": truth, "pods": seq, "events": events, "churn_end": clock.wall()})
        await asyncio.to_thread(stop.wait)
        await fake.close()

    asyncio.run(main())


def control_plane_process(urls: Queue[Any], results: Queue[Any], stop: multiprocessing.synchronize.Event) -> None:
    from tests.fakes.control_plane import FakeControlPlane

    async def main() -> None:
        plane = FakeControlPlane()
        await plane.start()
        urls.put(plane.url)
        await asyncio.to_thread(stop.wait)
        results.put({"records": len(plane.records), "billed_seconds": plane.total_seconds,
                     "requests": plane.requests, "duplicates": plane.duplicates, "conflicts": len(plane.conflicts),
                     "overlaps": len(plane.overlaps())})
        await plane.stop()

    asyncio.run(main())


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by native thread id."""
    out: dict[int, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def agent(args: argparse.Namespace, start: float, kube_url: str, plane_url: str, spool_dir: str,
                churn_results: Queue[Any]) -> dict[str, Any]:
    from kubernetes_asyncio.client import ApiClient, Configuration
    from prometheus_client import CollectorRegistry

    from region_agent.kube.resources import PODS
    from region_agent.kube.settings import WatchSettings
    from region_agent.kube.watch import Informer
    from region_agent.usage import MeteredPod, UsageService, UsageSettings, pod_converter, pod_selectors
    from tests.conftest import wait_for

    clock = ScaledClock(start, args.speed)
    settings = UsageSettings(spool_path=f"{spool_dir}/usage.sqlite3", endpoint_url=plane_url, token="test-token",
                             token_file=None, checkpoint_interval=args.checkpoint, report_interval=2.0,
                             batch_size=500)
    registry = CollectorRegistry()
    label_selector, field_selector = pod_selectors(settings, NODE)
    async with ApiClient(Configuration(host=kube_url)) as api:
        informer: Informer[MeteredPod] = Informer(
            api=api, resource=PODS, convert=pod_converter(settings), label_selector=label_selector,
            field_selector=field_selector, settings=WatchSettings(), registry=registry, name="usage-pods")
        service = UsageService(settings, region="sfo1", node=NODE, pods=informer, registry=registry, clock=clock,
                               sleep=clock.sleep)
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(informer.run()), loop.create_task(service.run())]
        await service.reconciled.wait()
        spool_tid = await service.spool._call(threading.get_native_id)
        await asyncio.sleep(max(0.0, start - time.time()))
        if args.profile:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        cpu0, wall0 = time.process_time(), time.monotonic()
        threads0 = thread_cpu()
        peak_open = peak_bytes = peak_unsent = 0.0
        churn: dict[str, Any] | None = None
        while churn is None:  # sample gauges while the churn runs (rarely: a registry read walks every metric)
            await asyncio.sleep(0.2 if args.smoke else 2.0)
            peak_open = max(peak_open, metric(registry, "region_agent_usage_open_sessions"))
            peak_bytes = max(peak_bytes, metric(registry, "region_agent_usage_spool_bytes"))
            peak_unsent = max(peak_unsent, metric(registry, "region_agent_usage_spool_unsent_records"))
            if not churn_results.empty():
                churn = churn_results.get()
        cpu1, wall1 = time.process_time(), time.monotonic()
        threads1 = thread_cpu()
        if args.profile:
            profiler.disable()
            profiler.dump_stats(args.profile)
        spool_cpu = threads1.get(spool_tid, 0.0) - threads0.get(spool_tid, 0.0)
        loop_tid = threading.get_native_id()
        loop_cpu = threads1.get(loop_tid, 0.0) - threads0.get(loop_tid, 0.0)
        sim_minutes = (churn["churn_end"] - BASE_WALL) / 60.0
        # Flush: every session closed, every record acknowledged.
        await wait_for(lambda: metric(registry, "region_agent_usage_open_sessions") == 0 and service.idle
                       and metric(registry, "region_agent_usage_spool_unsent_records") == 0
                       and metric(registry, "region_agent_usage_records_reported_total")
                       == metric(registry, "region_agent_usage_records_written_total"),
                       timeout=300, interval=0.05, message="backlog flushed")
        cpu2 = time.process_time()
        out = {
            "sim_minutes": sim_minutes, "real_seconds": wall1 - wall0, "cpu_seconds": cpu1 - cpu0,
            "flush_cpu_seconds": cpu2 - cpu1, "loop_cpu_seconds": loop_cpu, "spool_cpu_seconds": spool_cpu,
            "peak_open_sessions": peak_open, "peak_spool_bytes": peak_bytes,
            "peak_unsent": peak_unsent,
            "records_written": metric(registry, "region_agent_usage_records_written_total"),
            "records_reported": metric(registry, "region_agent_usage_records_reported_total"),
            "posts": service.reporter.posts, "churn": churn,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        for task in reversed(tasks):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods-per-minute", type=int, default=1000, help="pods started (and ended) per minute")
    parser.add_argument("--resident", type=int, default=100, help="pods running at any moment (mean)")
    parser.add_argument("--minutes", type=float, default=3.0, help="simulated minutes of churn")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="simulated seconds per real second (> 1 flatters CPU per minute; see above)")
    parser.add_argument("--checkpoint", type=float, default=60.0, help="checkpoint interval (simulated s)")
    parser.add_argument("--profile", metavar="FILE", help="cProfile the agent's event loop thread into FILE")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="event loop of the agent process (the agent runs on uvloop)")
    add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:  # every lifecycle step of a few pods, compressed: proves the path, measures nothing
        args.pods_per_minute, args.resident, args.minutes, args.speed = 600, 10, 0.5, 30.0
    with Results("usage_churn", args.out, smoke=args.smoke) as results:
        result, plane_stats = run(args)
        per_min = result["cpu_seconds"] / result["sim_minutes"]
        results.add("churn", pods_per_minute=args.pods_per_minute, resident=args.resident, speed=args.speed,
                    checkpoint=args.checkpoint, loop=args.loop, cpu_seconds_per_sim_minute=per_min,
                    percent_of_core_at_real_speed=100 * per_min / 60, **result)
        results.add("control_plane", billed_minus_true_seconds=plane_stats["billed_seconds"]
                    - result["churn"]["truth_seconds"], **plane_stats)


def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:

    ctx = multiprocessing.get_context("spawn")
    urls: Queue[Any] = ctx.Queue()
    churn_results: Queue[Any] = ctx.Queue()
    plane_results: Queue[Any] = ctx.Queue()
    stop = ctx.Event()
    starts: Queue[float] = ctx.Queue()
    kube = ctx.Process(target=churn_process, args=(args, starts, urls, churn_results, stop), name="kube")
    plane = ctx.Process(target=control_plane_process, args=(urls, plane_results, stop), name="control-plane")
    kube.start()
    plane.start()
    try:
        got = sorted([urls.get(timeout=30), urls.get(timeout=30)], key=lambda u: "/v1/usage" in u)
        kube_url, plane_url = got
        # imported before the clock starts
        for module in ("kubernetes_asyncio.client", "region_agent.usage", "region_agent.kube.watch"):
            importlib.import_module(module)
        # every process maps time from this instant; the agent lists and starts meanwhile
        start = time.time() + (1.0 if args.smoke else 2.0)
        starts.put(start)
        with tempfile.TemporaryDirectory(prefix="usage-bench-") as spool_dir:
            coro = agent(args, start, kube_url, plane_url, spool_dir, churn_results)
            assert kube.pid is not None and plane.pid is not None
            with Foreign([kube.pid, plane.pid]) as foreign:  # other people's load meanwhile
                if args.loop == "uvloop":  # what `region-agent run` uses (region_agent/cli/main.py)
                    import uvloop
                    result = uvloop.run(coro)
                else:
                    result = asyncio.run(coro)
            result["foreign_busy_percent"] = foreign.percent
        stop.set()
        plane_stats = plane_results.get(timeout=30)
    finally:
        stop.set()
        for proc in (kube, plane):
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    churn = result["churn"]
    per_min = result["cpu_seconds"] / result["sim_minutes"]
    print(f"usage churn bench: {args.pods_per_minute} pods/min, ~{args.resident} resident, "
          f"{result['sim_minutes']:.1f} simulated min at x{args.speed:g} ({result['real_seconds']:.1f} s real), "
          f"checkpoint {args.checkpoint:g} s, {args.loop} loop; other load meanwhile "
          f"{result['foreign_busy_percent']:.0f}% of all cores")
    print(f"  watch events               {churn['events']} ({churn['events'] / result['sim_minutes']:.0f}/min), "
          f"pods {churn['pods']}")
    print(f"  records spooled / acked    {result['records_written']:.0f} / {result['records_reported']:.0f} "
          f"({result['records_written'] / result['sim_minutes']:.0f}/min) in {result['posts']} POSTs")
    print(f"  peak open sessions         {result['peak_open_sessions']:.0f}")
    print(f"  peak spool live bytes      {result['peak_spool_bytes'] / 1024:.0f} KiB, "
          f"peak unsent {result['peak_unsent']:.0f}")
    print(f"  agent CPU                  {result['cpu_seconds']:.2f} s over the churn = {per_min:.3f} s per "
          f"simulated minute = {100 * per_min / 60:.2f}% of one core at real speed (goal < 5%)")
    print(f"  of which                   event loop thread {result['loop_cpu_seconds']:.2f} s, "
          f"spool thread {result['spool_cpu_seconds']:.2f} s, other threads "
          f"{result['cpu_seconds'] - result['loop_cpu_seconds'] - result['spool_cpu_seconds']:.2f} s")
    print(f"  agent CPU for the flush    {result['flush_cpu_seconds']:.2f} s; max RSS {result['rss_mb']:.0f} MB")
    print(f"  control plane              {plane_stats['records']} records, {plane_stats['requests']} requests, "
          f"{plane_stats['duplicates']} duplicates, {plane_stats['conflicts']} conflicts, "
          f"{plane_stats['overlaps']} overlaps")
    delta = plane_stats["billed_seconds"] - churn["truth_seconds"]
    print(f"  billed vs true pod-seconds {plane_stats['billed_seconds']} vs {churn['truth_seconds']} "
          f"(delta {delta:+d}; a session end may be billed up to 1 s late when its event arrives after a "
          f"checkpoint)")
    return result, plane_stats


if __name__ == "__main__":
    main()
