"""The listener's request log: JSON lines with request_id, region, path, status, latency.

Logging every request is not sane on this path: at 15,000 requests/s one JSON line each
would cost more CPU than the answers themselves and flood the node's log pipeline with
``200 ok`` lines that say nothing the ``region_agent_health_requests_total`` counter does
not. So, by default:

- answers other than 2xx (503 with a reason, 404, 405, 500, and the 400 of a malformed
  request, without a traceback) are logged at info: they are
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

from prometheus_client import Counter

__all__ = ["LOGGER_NAME", "RequestLog", "TokenBucket"]

LOGGER_NAME = "region_agent.health"
_MAX_PATH = 200


class TokenBucket:
    """``per_second`` tokens a second, at most ``burst`` saved; counts what it refused."""

    __slots__ = ("_burst", "_last", "_monotonic", "_rate", "_tokens", "dropped")

    def __init__(self, per_second: float, *, burst: float | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._rate = per_second
        self._burst = max(1.0, per_second if burst is None else burst)
        self._tokens = self._burst
        self._monotonic = monotonic
        self._last = monotonic()
        self.dropped = 0  # refused since the caller last reset it

    def take(self) -> bool:
        if self._rate <= 0:
            return False
        now = self._monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.dropped += 1
        return False


class RequestLog:
    __slots__ = ("_bucket", "_logger", "_region", "_suppressed_total")

    def __init__(
        self,
        *,
        region: str,
        per_second: float,
        suppressed: Counter,
        logger: logging.Logger | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``suppressed`` counts the lines the limit dropped (shared by the process's listeners)."""
        self._region = region
        self._logger = logger or logging.getLogger(LOGGER_NAME)
        self._bucket = TokenBucket(per_second, monotonic=monotonic)
        self._suppressed_total = suppressed

    def record(
        self, *, method: str, path: str, status: int, seconds: float, request_id: str, reason: str
    ) -> None:
        """Hot path: returns at once for a 2xx answer unless debug logging is on."""
        debug = self._logger.isEnabledFor(logging.DEBUG)
        if status < 300 and not debug:
            return
        if not debug and not self._bucket.take():
            self._suppressed_total.inc()
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
        bucket = self._bucket
        if bucket.dropped:
            extra["suppressed"] = bucket.dropped
            bucket.dropped = 0
        level = logging.DEBUG if status < 300 else logging.INFO
        self._logger.log(level, "%s %s %d", method, path[:_MAX_PATH], status, extra=extra)
