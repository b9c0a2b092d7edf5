"""Poll the CloudNativePG instance manager of every bound Cluster (the I/O half of data status).

One polling task per Cluster in the Cluster informer's cache, started and stopped as Clusters
come and go. Each poll:

1. finds the Cluster's ``currentPrimary`` pod **through the Kubernetes API** (GET the pod, cached
   until the primary changes or a poll fails). The pod gives both the address (``status.podIP``)
   and the scheme: CloudNativePG serves the status port over TLS exactly when the ``postgres``
   container runs with ``--status-port-tls``, which is how the operator itself decides.
   ``status.instancesReportedState[*].ip`` would save the GET but exists only from CNPG 1.26 and
   says nothing about TLS.
2. ``GET <scheme>://<ip>:8000/pg/status`` and, for an instance in recovery,
   ``GET http://<ip>:9187/metrics`` for ``cnpg_pg_replication_lag`` (optional: a failing exporter
   only leaves the lag unknown).

Every request has a total timeout; failures back off with full jitter per binding up to
``backoff_cap``; successes repeat every ``poll_interval`` (±10 % jitter so bindings do not poll in
lockstep). Metrics: polls by result, last success time, streaming flag and lag per binding.
The decision itself is :func:`region_agent.kube.cnpg_status.binding_status` (pure).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from region_agent.base.clock import Backoff, Clock, SystemClock
from region_agent.kube.api import KubeRequests
from region_agent.kube.cnpg_status import Observation, binding_status, parse_instance_status, parse_replication_lag
from region_agent.kube.errors import MalformedObjectError
from region_agent.kube.metrics import CnpgMetrics
from region_agent.kube.models import CnpgCluster
from region_agent.kube.resources import PODS
from region_agent.kube.settings import KubeSettings
from region_agent.kube.watch import Informer
from region_agent.state.local import BindingStatus

logger = logging.getLogger("region_agent.kube.cnpg")

POSTGRES_CONTAINER = "postgres"
TLS_FLAG = "--status-port-tls"


@dataclass(frozen=True, slots=True)
class InstanceAddress:
    pod: str
    ip: str
    scheme: str  # "http" or "https"


def instance_address(pod: Mapping[str, Any]) -> InstanceAddress:
    """Address and scheme of a CNPG instance pod; :class:`MalformedObjectError` without an IP yet."""
    metadata = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    assert isinstance(metadata, Mapping) and isinstance(status, Mapping) and isinstance(spec, Mapping)
    ip = status.get("podIP")
    if not isinstance(ip, str) or not ip:
        raise MalformedObjectError(f"pod {metadata.get('name')!r} has no IP yet")
    scheme = "http"
    for container in spec.get("containers") or []:
        if isinstance(container, Mapping) and container.get("name") == POSTGRES_CONTAINER:
            command = container.get("command") or []
            if isinstance(command, list) and TLS_FLAG in command:
                scheme = "https"
            break
    return InstanceAddress(str(metadata.get("name", "")), ip, scheme)


class CnpgStatusPoller:
    """Keeps an :class:`Observation` and a :class:`BindingStatus` per bound Cluster current."""

    def __init__(
        self,
        *,
        api: Any,
        clusters: Informer[CnpgCluster],
        settings: KubeSettings,
        registry: CollectorRegistry,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._clusters = clusters
        self._settings = settings
        self._cnpg = settings.cnpg
        self._clock: Clock = clock or SystemClock()
        self._rng = rng or random.Random()
        self._kube = KubeRequests(api, connect_timeout=settings.watch.connect_timeout)
        self._metrics = CnpgMetrics.for_registry(registry)
        self._observations: dict[str, Observation] = {}
        self._statuses: dict[str, BindingStatus] = {}
        self._addresses: dict[str, InstanceAddress] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._membership_changed = asyncio.Event()
        clusters.add_handler(lambda _event: self._membership_changed.set())
        clusters.add_state_listener(self._membership_changed.set)

    @property
    def statuses(self) -> Mapping[str, BindingStatus]:
        """``namespace/name`` of the Cluster → its latest binding status."""
        return self._statuses

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever a binding status changes."""
        self._listeners.append(listener)

    async def run(self) -> None:
        """Start and stop per-Cluster polling tasks as the Cluster cache changes; until cancelled."""
        ssl_context = self._ssl_context()
        connector = aiohttp.TCPConnector(ssl=ssl_context, limit=32, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                while True:
                    self._reconcile(session)
                    await self._membership_changed.wait()
                    self._membership_changed.clear()
            finally:
                tasks = list(self._tasks.values())
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _reconcile(self, session: aiohttp.ClientSession) -> None:
        wanted = set(self._clusters.items)
        for key in list(self._tasks):
            if key not in wanted:
                self._tasks.pop(key).cancel()
                self._forget(key)
        for key in wanted:
            if key not in self._tasks:
                self._tasks[key] = asyncio.get_running_loop().create_task(
                    self._poll_forever(key, session), name=f"cnpg-status {key}"
                )
            else:
                self._update_status(key)  # the Cluster changed (primary, deletion): re-judge now

    def _forget(self, key: str) -> None:
        self._observations.pop(key, None)
        self._addresses.pop(key, None)
        if self._statuses.pop(key, None) is not None:
            self._notify()

    async def _poll_forever(self, key: str, session: aiohttp.ClientSession) -> None:
        backoff = Backoff(initial=min(1.0, self._cnpg.poll_interval), cap=self._cnpg.backoff_cap, rng=self._rng)
        while True:
            cluster = self._clusters.items.get(key)
            if cluster is None:
                return
            try:
                observation = await self._poll(key, cluster, session)
                ok = True
            except asyncio.CancelledError:
                raise
            except Exception as error:
                ok = False
                self._addresses.pop(key, None)  # re-resolve the pod next time
                previous = self._observations.get(key) or Observation()
                observation = replace(previous, error=_describe(error))
                logger.warning("cnpg status of %s: %s", key, observation.error)
            self._observations[key] = observation
            self._record(cluster, ok, observation)
            self._update_status(key)
            if ok:
                backoff.reset()
                delay = self._cnpg.poll_interval * (0.9 + 0.2 * self._rng.random())
            else:
                delay = backoff.next_delay(self._clock.monotonic())
            await asyncio.sleep(delay)

    async def _poll(self, key: str, cluster: CnpgCluster, session: aiohttp.ClientSession) -> Observation:
        if cluster.current_primary is None:
            return Observation(error="no current primary")
        address = self._addresses.get(key)
        if address is None or address.pod != cluster.current_primary:
            pod = await self._kube.get_json(
                PODS.object_path(cluster.namespace, cluster.current_primary),
                [],
                timeout=self._cnpg.request_timeout,
            )
            address = instance_address(pod)
            self._addresses[key] = address
        document = await self._get(session, f"{address.scheme}://{address.ip}:{self._cnpg.status_port}/pg/status")
        status = parse_instance_status(json.loads(document))
        lag = None
        if not status.is_primary and self._cnpg.metrics_port is not None:
            try:
                text = await self._get(session, f"http://{address.ip}:{self._cnpg.metrics_port}/metrics")
                lag = parse_replication_lag(text.decode("utf-8", "replace"))
            except (aiohttp.ClientError, TimeoutError, OSError) as error:
                logger.info("cnpg metrics of %s unavailable: %s", key, _describe(error))
        return Observation(status=status, lag_seconds=lag, observed_at=self._clock.wall())

    async def _get(self, session: aiohttp.ClientSession, url: str) -> bytes:
        timeout = aiohttp.ClientTimeout(total=self._cnpg.request_timeout)
        async with asyncio.timeout(self._cnpg.request_timeout), session.get(url, timeout=timeout) as response:
            body = await response.read()
            if response.status != 200:
                raise aiohttp.ClientResponseError(
                    response.request_info,
                    (),
                    status=response.status,
                    message=body[:200].decode("utf-8", "replace"),
                )
            return body

    def _update_status(self, key: str) -> None:
        cluster = self._clusters.items.get(key)
        if cluster is None:
            return
        slug = cluster.label(self._settings.binding_label) or ""
        status = binding_status(
            slug=slug,
            cluster=cluster,
            observation=self._observations.get(key),
            now=self._clock.wall(),
            lag_threshold=self._settings.lag_threshold,
            grace=self._cnpg.grace,
        )
        labels = (cluster.namespace, cluster.name)
        self._metrics.streaming.labels(*labels).set(1 if status.streaming else 0)
        self._metrics.lag_seconds.labels(*labels).set(
            float("nan") if status.lag_seconds is None else status.lag_seconds
        )
        if self._statuses.get(key) != status:
            self._statuses[key] = status
            self._notify()

    def _record(self, cluster: CnpgCluster, ok: bool, observation: Observation) -> None:
        labels = (cluster.namespace, cluster.name)
        self._metrics.polls.labels(*labels, "ok" if ok else "error").inc()
        if ok and observation.observed_at is not None:
            self._metrics.last_success.labels(*labels).set(observation.observed_at)

    def _notify(self) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                logger.exception("cnpg status listener %r failed", listener)

    def _ssl_context(self) -> ssl.SSLContext:
        if self._cnpg.ca_file:
            context = ssl.create_default_context(cafile=self._cnpg.ca_file)
            context.check_hostname = False  # the certificate names the pod, we dial its IP
            return context
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= 200 else text[:200] + "…"
