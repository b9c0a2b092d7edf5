"""The listener's request log: JSON lines with request_id, region, path, status, latency.

Logging every request is not sane on this path: at 15,000 requests/s one JSON line each
would cost more CPU than the answers themselves and flood the node's log pipeline with
``200 ok`` lines that say nothing the ``region_agent_health_requests_total`` counter does
not. So, by default:

- answers other than 2xx (503 with a reason, 404, 405, 500) are logged at info: they are
  what an operator greps for ("why was shop down in sfo1 at 10:02?");
- those go through a token bucket (``request_log_per_second``, burst of the same size) so a
  flood of 503s can not turn into a flood of log lines; the next line written carries
  ``suppressed``, the number dropped since the previous one, and a counter totals them;
- with the ``region_agent.health`` logger at debug, every request is logged, unlimited
  (for development, never in production).

aiohttp's own access log is off (it formats a line per request even when filtered out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

__all__ = ["LOGGER_NAME", "RequestLog"]

LOGGER_NAME = "region_agent.health"
_MAX_PATH = 200


class RequestLog:
    __slots__ = (
        "_burst", "_dropped", "_last", "_logger", "_monotonic", "_rate", "_region",
        "_suppressed_total", "_tokens",
    )

    def __init__(
        self,
        *,
        region: str,
        per_second: float,
        registry: CollectorRegistry,
        logger: logging.Logger | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._region = region
        self._logger = logger or logging.getLogger(LOGGER_NAME)
        self._rate = per_second
        self._burst = max(1.0, per_second)
        self._tokens = self._burst
        self._monotonic = monotonic
        self._last = monotonic()
        self._dropped = 0
        self._suppressed_total = Counter(
            "region_agent_health_request_logs_suppressed",
            "Request log lines dropped by the request_log_per_second limit (the requests were answered).",
            registry=registry,
        )

    def record(
        self, *, method: str, path: str, status: int, seconds: float, request_id: str, reason: str
    ) -> None:
        """Hot path: returns at once for a 2xx answer unless debug logging is on."""
        debug = self._logger.isEnabledFor(logging.DEBUG)
        if status < 300 and not debug:
            return
        if not debug and not self._take_token():
            return
        extra: dict[str, object] = {
            "request_id": request_id,
            "region": self._region,
            "method": method,
            "path": path[:_MAX_PATH],
            "status": status,
            "latency_ms": round(seconds * 1000, 3),
        }
        if reason:
            extra["reason"] = reason
        if self._dropped:
            extra["suppressed"] = self._dropped
            self._dropped = 0
        level = logging.DEBUG if status < 300 else logging.INFO
        self._logger.log(level, "%s %s %d", method, path[:_MAX_PATH], status, extra=extra)

    def _take_token(self) -> bool:
        if self._rate <= 0:
            return False
        now = self._monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self._dropped += 1
        self._suppressed_total.inc()
        return False
