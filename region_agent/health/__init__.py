"""The health listener (port 8086) and its sidecar mode; see region_agent/health/README.md.

Import the modules directly (``region_agent.health.service``, ``region_agent.health.sidecar``, ...): this package
imports nothing at import time, so ``python -m region_agent.health.sidecar`` runs cleanly.
"""
