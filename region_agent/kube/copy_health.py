"""Is a project's copy in this region serving? Pure rules over slim records (PLATFORM.md §1.3).

A copy is healthy while it **serves a version**: some revision carries traffic in the Service's
``status.traffic``. The Route only puts ready revisions there (``rev.IsReady()``), so traffic
with a positive percent means a ready revision answers requests. ``Ready`` alone is not used:

===========================================  ===========  ===================================
Service state                                 healthy      reason
===========================================  ===========  ===================================
rolled out, traffic on the latest revision    yes          ok
scaled to zero (Ready stays True)             yes          ok
new revision failed, old one still serving    yes          ok (detail names the failed one)
rollout in progress (RoutesReady Unknown)     yes          ok (traffic still on old revisions)
first revision failed / none ready yet        no           no-ready-revision
RoutesReady=False (ingress, certificate...)   no           route-not-ready
ready revision but no traffic assigned        no           route-not-ready
Service being deleted                         no           not-found
no Service for the slug                       no           not-found
watch cache not synced yet                    no           cache-not-synced
===========================================  ===========  ===================================

Data: a copy with CloudNativePG bindings is unhealthy (``data-not-streaming``) while any of its
bindings' data condition fails (see :mod:`region_agent.kube.cnpg_status`); lag over the threshold does
not make it unhealthy (the region is reported degraded instead). A copy without bindings has no
data condition. Service problems are reported before data problems: the first cause wins.

Which Services are copies is decided by the label selector of the watch; the slug is the value of
``slug_label`` or, without it, the Service's name, and must be a valid slug (one DNS label).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

from region_agent.base.names import project_slug
from region_agent.kube.models import KnativeService
from region_agent.state.local import BindingStatus, CopyReason, CopyStatus


class _Where(TypedDict):
    namespace: str
    service: str


def slug_of(service: KnativeService, slug_label: str) -> str | None:
    """The project slug a Service is a copy of, or None when neither label nor name is a valid slug."""
    for candidate in (service.label(slug_label), service.name):
        if candidate:
            try:
                return project_slug(candidate)
            except ValueError:  # not a valid slug: try the next candidate
                continue
    return None


def serving_revisions(service: KnativeService) -> tuple[str, ...]:
    """Revisions with a positive share of ``status.traffic``, in order, without duplicates."""
    seen: dict[str, None] = {}
    for target in service.traffic:
        if target.percent > 0:
            seen.setdefault(target.revision)
    return tuple(seen)


def service_status(slug: str, service: KnativeService | None) -> CopyStatus:
    """Health of the copy judged by its Knative Service alone (no data condition)."""
    if service is None:
        return CopyStatus(slug, False, CopyReason.NOT_FOUND, "no Knative Service for this project in the region")
    where = _Where(namespace=service.namespace, service=service.name)
    if service.deleting:
        return CopyStatus(slug, False, CopyReason.NOT_FOUND, "the Knative Service is being deleted", **where)
    routes = service.condition("RoutesReady")
    serving = serving_revisions(service)
    if not serving or (routes is not None and routes.status == "False"):
        if service.latest_ready_revision is None or (routes is not None and routes.reason == "RevisionMissing"):
            return CopyStatus(
                slug,
                False,
                CopyReason.NO_READY_REVISION,
                _explain(service, "ConfigurationsReady", "RoutesReady", "Ready", default="no revision is ready"),
                **where,
            )
        return CopyStatus(
            slug,
            False,
            CopyReason.ROUTE_NOT_READY,
            _explain(service, "RoutesReady", "Ready", default="no revision carries traffic"),
            **where,
        )
    return CopyStatus(slug, True, CopyReason.OK, _serving_detail(service, serving), revisions=serving, **where)


def copy_status(slug: str, service: KnativeService | None, bindings: Iterable[BindingStatus] = ()) -> CopyStatus:
    """Health of the copy: the Service rules, then the data condition of its bindings."""
    return with_data_condition(service_status(slug, service), bindings)


def with_data_condition(status: CopyStatus, bindings: Iterable[BindingStatus]) -> CopyStatus:
    """Apply the bindings' data condition to a Service-only status (Service problems come first)."""
    if not status.healthy:
        return status
    broken = [b for b in bindings if not b.streaming]
    if not broken:
        return status
    detail = "; ".join(f"{b.namespace}/{b.name}: {b.detail or 'not streaming'}" for b in broken)
    return CopyStatus(
        status.slug,
        False,
        CopyReason.DATA_NOT_STREAMING,
        detail,
        namespace=status.namespace,
        service=status.service,
        revisions=status.revisions,
    )


def not_synced_status(slug: str) -> CopyStatus:
    return CopyStatus(slug, False, CopyReason.CACHE_NOT_SYNCED, "the watch cache has not completed its first list")


def _explain(service: KnativeService, *kinds: str, default: str) -> str:
    for kind in kinds:
        condition = service.condition(kind)
        if condition is not None and condition.status != "True" and (condition.reason or condition.message):
            return f"{kind}={condition.status} {condition.reason}: {condition.message}".strip().rstrip(":")
    return default


def _serving_detail(service: KnativeService, serving: tuple[str, ...]) -> str:
    failed = service.latest_created_revision
    configurations = service.condition("ConfigurationsReady")
    if failed and failed not in serving and configurations is not None and configurations.status == "False":
        return f"serving {', '.join(serving)}; latest revision {failed} failed: {configurations.message}".rstrip(": ")
    if failed and failed != service.latest_ready_revision:
        return f"serving {', '.join(serving)}; rollout of {failed} in progress"
    return f"serving {', '.join(serving)}"
