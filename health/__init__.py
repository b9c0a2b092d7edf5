"""The health listener (port 8086) and its sidecar mode; see health/README.md.

Import the modules directly (``health.service``, ``health.sidecar``, ...): this package
imports nothing at import time, so ``python -m health.sidecar`` runs cleanly.
"""
