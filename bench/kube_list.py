"""Initial LIST of N Knative Services into the informer cache: time and memory.

Goals (issue 3): 10,000 Services listed into the cache in under 3 s; the process holding them
under 100 MB RSS.

The fake apiserver runs in a separate process (spawned, not forked), so the numbers are the
agent side only: the real kubernetes_asyncio client over loopback HTTP, JSON parsing of every
page, conversion to slim ``KnativeService`` records, and the cache. Each Service is realistic
in size (labels, annotations, managedFields, template, status with conditions and traffic;
about 4.5 KiB of JSON each with the default padding).

Run from the repository root::

    python bench/kube_list.py                 # 10,000 Services, default page size
    python bench/kube_list.py --services 20000 --page-size 1000 --padding 10000
    python bench/kube_list.py --smoke         # 200 small Services: does it run?

Results: ``bench/README.md``; every run writes its raw results to the JSON lines file it names at
the end (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import multiprocessing.synchronize
import resource
import sys
import time
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Foreign, Results, add_arguments

from region_agent.kube.settings import WatchSettings

PROJECT_LABEL = "region-agent.io/project"  # the default copy label (KubeSettings)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def serve(count: int, padding: int, urls: Queue[str], stop: multiprocessing.synchronize.Event) -> None:
    """The fake apiserver process (imported here so the measured process never loads it)."""
    from region_agent.kube.resources import KNATIVE_SERVICES
    from tests.fakes.kube_api import FakeKubeApi
    from tests.fakes.kube_objects import knative_service

    async def main() -> None:
        fake = FakeKubeApi()
        for index in range(count):
            service = knative_service(f"project-{index:05d}", namespace=f"ns-{index % 50}")
            # managedFields is most of a real Service's bytes; pad to a realistic object size
            service["metadata"]["managedFields"].append(
                {"manager": "kubectl", "operation": "Apply", "fieldsV1": {"f:spec": {"f:x": "y" * padding}}}
            )
            fake.put(KNATIVE_SERVICES, service)
        urls.put(await fake.start())
        await asyncio.to_thread(stop.wait)
        await fake.close()

    asyncio.run(main())


async def measure(url: str, count: int, page_size: int) -> dict[str, Any]:
    # imported here: the spawned fake apiserver imports this module again and needs none of it
    from kubernetes_asyncio.client import ApiClient, Configuration
    from prometheus_client import CollectorRegistry

    from region_agent.kube.models import KnativeService
    from region_agent.kube.resources import KNATIVE_SERVICES
    from region_agent.kube.watch import Informer

    gc.collect()
    before = rss_mb()
    settings = WatchSettings(page_size=page_size)
    async with ApiClient(Configuration(host=url)) as api:
        informer: Informer[KnativeService] = Informer(
            api=api,
            resource=KNATIVE_SERVICES,
            convert=lambda obj: KnativeService.from_api(obj, keep_labels=(PROJECT_LABEL,)),
            label_selector=PROJECT_LABEL,
            settings=settings,
            registry=CollectorRegistry(),
            name="bench",
        )
        started = time.perf_counter()
        task = asyncio.create_task(informer.run())
        await asyncio.wait_for(informer.synced.wait(), timeout=120)
        elapsed = time.perf_counter() - started
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert len(informer.items) == count, len(informer.items)
        gc.collect()
        after = rss_mb()
        return {
            "services": count,
            "page_size": page_size,
            "list_seconds": elapsed,
            "rss_before_mb": before,
            "rss_with_cache_mb": after,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--page-size", type=int, default=WatchSettings().page_size)
    parser.add_argument("--padding", type=int, default=3000, help="extra bytes per Service (managedFields)")
    add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.services, args.page_size, args.padding = 200, 50, 300  # several pages, still under a second

    with Results("kube_list", args.out, smoke=args.smoke) as results:
        result = run(args)
        results.add("list", padding_bytes=args.padding, **result)


def run(args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    urls: Queue[str] = context.Queue()
    stop = context.Event()
    server = context.Process(target=serve, args=(args.services, args.padding, urls, stop), daemon=True)
    server.start()
    try:
        url = urls.get(timeout=300)
        assert server.pid is not None
        with Foreign([server.pid]) as foreign:  # the list is timed in wall-clock: say how busy the machine was
            result = asyncio.run(measure(url, args.services, args.page_size))
        result["foreign_busy_percent"] = foreign.percent
    finally:
        stop.set()
        server.join(timeout=10)
    print(
        f"initial LIST of {result['services']} Services (pages of {result['page_size']}): "
        f"{result['list_seconds']:.2f} s  (goal < 3 s; other load meanwhile {result['foreign_busy_percent']:.0f}% "
        "of all cores)"
    )
    print(
        f"RSS before list: {result['rss_before_mb']:.1f} MB; with {result['services']} cached: "
        f"{result['rss_with_cache_mb']:.1f} MB (goal < 100 MB); peak: {result['peak_rss_mb']:.1f} MB"
    )
    return result


if __name__ == "__main__":
    main()
