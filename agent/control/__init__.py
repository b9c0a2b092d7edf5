"""The control API: the control plane writes projects, regions and fences through any one agent."""

from agent.control.api import PREFIX, ROUTES, ControlAPI, load_openapi
from agent.control.idempotency import IdempotencyCache

__all__ = ["PREFIX", "ROUTES", "ControlAPI", "IdempotencyCache", "load_openapi"]
