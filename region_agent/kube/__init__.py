"""The Kubernetes side of the agent: informers, slim records, copy health and data status.

Layers, lowest first (each module's docstring gives its design reason):

* ``settings``    ``KubeSettings`` (+ ``WatchSettings``, ``CnpgStatusSettings``), composed by the lead.
* ``client``      ``build_api_client(settings)``: kubernetes_asyncio ``ApiClient`` (in-cluster/kubeconfig).
* ``resources``   ``ResourceRef`` and ``PODS``, ``KNATIVE_SERVICES``, ``CNPG_CLUSTERS``.
* ``api``         the two HTTP calls (GET JSON, JSON-lines stream) over ``ApiClient.call_api``.
* ``cache``       ``Cache[T]`` and ``WatchEvent[T]``: pure store semantics (relist → DELETED).
* ``watch``       ``Informer[T]``: list + watch of any collection (PLATFORM.md §2.5).
* ``models``      ``KnativeService``, ``CnpgCluster`` records and ``from_api`` converters.
* ``copy_health`` pure: a Knative Service (+ bindings) → ``CopyStatus`` (PLATFORM.md §1.3).
* ``cnpg_status`` pure: instance-manager status → ``BindingStatus`` (PLATFORM.md §5.2).
* ``cnpg_poller`` polls ``/pg/status`` (and the exporter's lag) of every bound Cluster.
* ``local_view``  pure: caches → ``dict[slug, CopyStatus]`` and ``tuple[BindingStatus, ...]``.
* ``sources``     ``KubeSources``: everything above wired from ``KubeSettings`` for the supervisor.

Only ``region_agent.base`` and ``region_agent.state`` are imported from the rest of the project.

Nothing is imported here: ``kubernetes_asyncio`` costs ~40 MB and 0.2 s to import, and an
agent without Kubernetes (standalone mode) must not pay for it just by reading its settings.
Import the module you need.
"""
