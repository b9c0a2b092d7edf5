"""The control API: the control plane writes projects, regions and fences through any one agent."""

from region_agent.control.api import PREFIX, ROUTES, ControlAPI, load_openapi
from region_agent.control.idempotency import IdempotencyCache

__all__ = ["PREFIX", "ROUTES", "ControlAPI", "IdempotencyCache", "load_openapi"]
