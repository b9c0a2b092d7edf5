"""Request ids of the form ``req_{region}-{unix ms}-{12 hex}``.

A caller that already has an id (a DNS server correlating its probes, another region's
agent) keeps it when it is well formed; anything else is replaced, never echoed, so a
client can not inject text into our headers and logs. The random part only has to make
ids unique, not unguessable, so it comes from a seeded PRNG instead of a syscall per
request (this runs on every answer of the hot path).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable

from region_agent.base.names import region_name

__all__ = ["REQUEST_ID_PATTERN", "RequestIds", "is_valid_request_id"]

# The region part follows region_agent.base.names (IATA code + number); 1-16 digits of unix ms.
REQUEST_ID_PATTERN = re.compile(r"req_[a-z]{3}[0-9]+-[0-9]{1,16}-[0-9a-f]{12}")
_MAX_LENGTH = 64  # checked before the regex, so a huge header costs nothing
_match = REQUEST_ID_PATTERN.fullmatch


def is_valid_request_id(value: str) -> bool:
    return len(value) <= _MAX_LENGTH and _match(value) is not None


class RequestIds:
    """Makes ids for one region; keeps valid incoming ones."""

    __slots__ = ("_bits", "_prefix", "_wall")

    def __init__(
        self, region: str, *, wall: Callable[[], float] = time.time, seed: int | None = None
    ) -> None:
        self._prefix = f"req_{region_name(region)}-"
        if len(self._prefix) + 16 + 1 + 12 > _MAX_LENGTH:
            raise ValueError(f"region name {region!r} is too long for request ids")
        self._wall = wall
        rng = random.Random(int.from_bytes(os.urandom(8)) if seed is None else seed)
        self._bits = rng.getrandbits

    def new(self) -> str:
        return f"{self._prefix}{int(self._wall() * 1000)}-{self._bits(48):012x}"

    def accept(self, incoming: str | None) -> str:
        """The incoming id when it is well formed, otherwise a new one."""
        if incoming and len(incoming) <= _MAX_LENGTH and _match(incoming) is not None:
            return incoming
        return self.new()
