"""Build a kubernetes_asyncio ``ApiClient`` from in-cluster config or a kubeconfig.

Only addresses and credentials come from here. Timeouts are per request and explicit
(:mod:`region_agent.kube.api` passes an ``aiohttp.ClientTimeout`` on every call), because
kubernetes_asyncio >= 32 has no default timeout at all (PLATFORM.md §2.4). In-cluster config
installs the library's token refresh hook, so a rotated projected service-account token is
picked up without a restart.
"""

from __future__ import annotations

import os
from typing import Any

from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration

from region_agent.kube.errors import KubeError
from region_agent.kube.settings import KubeSettings

IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"


class KubeConfigError(KubeError):
    """No usable Kubernetes configuration (names where it looked)."""


async def load_configuration(settings: KubeSettings, *, environ: dict[str, str] | None = None) -> Any:
    """A ``Configuration`` for the mode in ``settings.config`` (auto: in-cluster inside a pod)."""
    env = os.environ if environ is None else environ
    mode = settings.config
    if mode == "auto":
        mode = "in-cluster" if env.get(IN_CLUSTER_ENV) else "kubeconfig"
    configuration = Configuration()
    try:
        if mode == "in-cluster":
            kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            await kube_config.load_kube_config(
                config_file=settings.kubeconfig,
                context=settings.context,
                client_configuration=configuration,
                persist_config=False,
            )
    except (kube_config.ConfigException, OSError) as error:
        where = (
            "the pod's service account"
            if mode == "in-cluster"
            else (settings.kubeconfig or env.get("KUBECONFIG") or "~/.kube/config")
        )
        raise KubeConfigError(
            f"kube.config={settings.config}: can not load {mode} configuration from {where}: {error}"
        ) from error
    return configuration


async def build_api_client(settings: KubeSettings) -> Any:
    """An ``ApiClient`` to pass to informers and the CNPG poller; close it with ``await client.close()``."""
    return ApiClient(await load_configuration(settings))


def api_client_for(host: str) -> Any:
    """An ``ApiClient`` for a plain URL without credentials (tests, benches, ``kubectl proxy``)."""
    return ApiClient(Configuration(host=host))
