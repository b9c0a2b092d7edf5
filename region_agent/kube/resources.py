"""Which Kubernetes collection an informer lists and watches.

A ``ResourceRef`` is only an address (group, version, plural, optional namespace); the
informer does not know or care what kind of object lives there. The three collections the
agent watches are named here so the wiring code and the fake API agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class ResourceRef:
    group: str  # "" for the core API (pods)
    version: str
    plural: str
    namespace: str | None = None  # None: all namespaces

    @property
    def path(self) -> str:
        """The collection URL path, e.g. ``/apis/serving.knative.dev/v1/namespaces/a/services``."""
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespace:
            root += f"/namespaces/{self.namespace}"
        return f"{root}/{self.plural}"

    def object_path(self, namespace: str, name: str) -> str:
        """The URL path of one namespaced object of this collection."""
        return f"{replace(self, namespace=namespace).path}/{name}"

    @property
    def label(self) -> str:
        """Short stable name for logs and metric labels: ``services.serving.knative.dev``, ``pods``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def in_namespace(self, namespace: str | None) -> ResourceRef:
        return replace(self, namespace=namespace)


PODS = ResourceRef("", "v1", "pods")
KNATIVE_SERVICES = ResourceRef("serving.knative.dev", "v1", "services")
CNPG_CLUSTERS = ResourceRef("postgresql.cnpg.io", "v1", "clusters")
