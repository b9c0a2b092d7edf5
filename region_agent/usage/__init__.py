"""Usage metering: sessions of the project pods on this node, spooled durably, reported idempotently.

Public surface for the supervisor: :class:`UsageSettings`, :class:`UsageService`,
:func:`pod_converter` and :func:`pod_selectors` (to build the pod informer the service reads).
See README.md for the design, the wire format and the metrics.
"""

from region_agent.usage.pods import MeteredPod, pod_converter, pod_selectors
from region_agent.usage.service import PodSource, UsageService
from region_agent.usage.settings import UsageSettings

__all__ = ["MeteredPod", "PodSource", "UsageService", "UsageSettings", "pod_converter", "pod_selectors"]
