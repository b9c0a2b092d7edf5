"""The usage service as a process of its own, for crash tests: ``python -m tests.agent.usage.agent_process``.

Wired exactly as the agent wires it (pod informer with the usage converter and selectors, then
``UsageService``), configured from the environment like the agent: ``REGION_AGENT_REGION``,
``REGION_AGENT_NODE``, ``REGION_AGENT_KUBE_URL`` (a plain apiserver URL, e.g. the fake's) and
``REGION_AGENT_USAGE__<FIELD>``. It prints ``reconciled`` on stdout once the spool was reconciled
with the first LIST, logs JSON lines on stderr, and stops gracefully on SIGTERM. It lives under
tests/ because it imports ``agent.kube``, which ``agent.usage`` must not (import contracts).
"""

from __future__ import annotations

import asyncio
import signal
import sys

from kubernetes_asyncio.client import ApiClient, Configuration
from prometheus_client import CollectorRegistry
from pydantic_settings import BaseSettings, SettingsConfigDict

from agent.base.logs import setup_logging
from agent.kube.resources import PODS
from agent.kube.settings import WatchSettings
from agent.kube.watch import Informer
from agent.usage import MeteredPod, UsageService, UsageSettings, pod_converter, pod_selectors


class ProcessSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REGION_AGENT_", env_nested_delimiter="__", extra="ignore")

    region: str = "sfo1"
    node: str
    kube_url: str
    usage: UsageSettings = UsageSettings()


async def main() -> None:
    settings = ProcessSettings()  # node and kube_url come from the environment
    setup_logging(region=settings.region)
    registry = CollectorRegistry()
    watch = WatchSettings(backoff_initial=0.05, backoff_cap=0.5, very_short_watch=0.0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with ApiClient(Configuration(host=settings.kube_url)) as api:
        label_selector, field_selector = pod_selectors(settings.usage, settings.node)
        informer: Informer[MeteredPod] = Informer(
            api=api, resource=PODS, convert=pod_converter(settings.usage), label_selector=label_selector,
            field_selector=field_selector, settings=watch, registry=registry, name="usage-pods")
        service = UsageService(settings.usage, region=settings.region, node=settings.node, pods=informer,
                               registry=registry)
        tasks = [loop.create_task(informer.run(), name="usage-pods informer"),
                 loop.create_task(service.run(), name="usage service")]
        await service.reconciled.wait()
        print("reconciled", flush=True)
        await stop.wait()
        for task in reversed(tasks):  # the service first: it checkpoints while the informer still runs
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    print("stopped", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
