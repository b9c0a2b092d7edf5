"""The ``region_agent.kube`` exception family: one ladder for every Kubernetes I/O edge.

The informer decides what to do by exception type, not by string matching:
``ResourceExpiredError`` means "relist", ``MalformedObjectError`` means "skip this object and count it",
everything else under ``KubeError`` means "back off and retry".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class KubeError(Exception):
    """Base of every error raised by ``region_agent.kube``."""


class ApiStatusError(KubeError):
    """The apiserver answered with a non-2xx status (or an ERROR event carrying a Status)."""

    def __init__(self, status: int, reason: str = "", message: str = "", causes: tuple[str, ...] = ()) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes

    @classmethod
    def from_status(cls, status: Mapping[str, Any], *, http_status: int | None = None) -> ApiStatusError:
        """Build from a ``meta/v1 Status`` body; tolerant of missing fields."""
        code = status.get("code")
        details = status.get("details")
        causes: tuple[str, ...] = ()
        if isinstance(details, Mapping) and isinstance(details.get("causes"), list):
            causes = tuple(str(c.get("reason", "")) for c in details["causes"] if isinstance(c, Mapping))
        the_code = code if isinstance(code, int) else (http_status or 0)
        error_type = ResourceExpiredError if _is_expired(the_code, str(status.get("reason", "")), causes) else cls
        return error_type(the_code, str(status.get("reason", "")), str(status.get("message", "")), causes)


class ResourceExpiredError(ApiStatusError):
    """410 Gone / Expired, or 504 ResourceVersionTooLarge: the resourceVersion can not be served.

    client-go treats both as "the cache must be rebuilt from a list" (PLATFORM.md §2.2).
    """


class MalformedObjectError(KubeError, ValueError):
    """An object (or event) from the apiserver that does not have the shape the agent needs."""


class StreamError(KubeError):
    """A watch stream that broke: oversize line, connection reset, a suspiciously short watch."""

    def __init__(self, message: str, *, reason: str = "stream") -> None:
        super().__init__(message)
        self.reason = reason  # short, for metric labels


def _is_expired(code: int, reason: str, causes: tuple[str, ...]) -> bool:
    if code == 410 or reason in ("Expired", "Gone"):
        return True
    return code == 504 and "ResourceVersionTooLarge" in causes
