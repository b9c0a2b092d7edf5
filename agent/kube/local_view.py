"""This region's copies and bindings, combined from the caches: one pure function.

The supervisor calls :func:`build_local_view` whenever a cache or the CNPG poller reports a
change (see :class:`agent.kube.sources.KubeSources`) and puts the result into the
``RegionView`` the health listener answers from, and into the replicated store as this region's
copy health.

Rules, on top of :mod:`agent.kube.copy_health`:

* Until the Service cache has completed its first LIST nothing is known: no copies (the
  ``RegionView`` is not synced, so the listener answers ``cache-not-synced``).
* While the CNPG Cluster cache is enabled but not synced, every copy is ``cache-not-synced``:
  without the Clusters the data condition can not be judged, and answering "healthy" could put
  a copy whose replica does not stream into DNS.
* Several Services with the same slug (e.g. in two namespaces) collapse to one copy: a healthy
  one wins, then the first by ``namespace/name``, so the answer is deterministic.
* A binding is a Cluster whose ``binding_label`` names the slug; a bound Cluster the poller has
  not judged yet counts as not streaming.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.kube.copy_health import copy_status, not_synced_status, slug_of
from agent.kube.models import CnpgCluster, KnativeService
from agent.state.local import BindingStatus, CopyStatus


@dataclass(frozen=True, slots=True)
class LocalView:
    copies: dict[str, CopyStatus] = field(default_factory=dict)
    bindings: tuple[BindingStatus, ...] = ()


def bindings_of(
    clusters: Mapping[str, CnpgCluster], statuses: Mapping[str, BindingStatus], *, binding_label: str
) -> tuple[BindingStatus, ...]:
    """One status per bound Cluster, sorted by ``namespace/name``."""
    result = []
    for key in sorted(clusters):
        cluster = clusters[key]
        slug = cluster.label(binding_label)
        if not slug:
            continue
        status = statuses.get(key)
        if status is None or status.slug != slug:
            status = BindingStatus(slug, cluster.namespace, cluster.name, False, None, "instance status not polled yet")
        result.append(status)
    return tuple(result)


def build_local_view(
    *,
    services: Mapping[str, KnativeService],
    services_synced: bool,
    slug_label: str,
    clusters: Mapping[str, CnpgCluster] | None = None,
    clusters_synced: bool = True,
    binding_statuses: Mapping[str, BindingStatus] | None = None,
    binding_label: str = "",
) -> LocalView:
    """Copies by slug and bindings; ``clusters=None`` means CNPG is not watched (no data conditions)."""
    if not services_synced:
        return LocalView()
    by_slug: dict[str, list[KnativeService]] = defaultdict(list)
    for key in sorted(services):
        slug = slug_of(services[key], slug_label)
        if slug is not None:
            by_slug[slug].append(services[key])

    bindings: tuple[BindingStatus, ...] = ()
    if clusters is not None:
        if not clusters_synced:
            return LocalView({slug: not_synced_status(slug) for slug in sorted(by_slug)})
        bindings = bindings_of(clusters, binding_statuses or {}, binding_label=binding_label)
    bindings_by_slug: dict[str, list[BindingStatus]] = defaultdict(list)
    for binding in bindings:
        bindings_by_slug[binding.slug].append(binding)

    copies: dict[str, CopyStatus] = {}
    for slug, candidates in sorted(by_slug.items()):
        statuses = [copy_status(slug, service, bindings_by_slug.get(slug, ())) for service in candidates]
        copies[slug] = next((s for s in statuses if s.healthy), statuses[0])
    return LocalView(copies, bindings)
