"""Response rate limiting in the style of BIND's RRL: pure, no sockets, the clock passed in.

A spoofed-source flood turns an authoritative server into an amplifier aimed at the spoofed
address: each small query draws a larger answer. RRL counts *responses* per client network
(a /24 for IPv4, a /56 for IPv6 by default) and per kind of answer, and once a network gets
more than its rate the surplus is dropped — except every ``slip``-th, which is sent as a
tiny TC=1 reply so that a real resolver behind a spoofed-looking burst retries over TCP
(which is never limited: a TCP handshake proves the source address).

Buckets (BIND's keys):

* a positive answer or NODATA: (network, lower-cased qname, qtype), ``responses_per_second``;
* NXDOMAIN: (network, zone) — a random-subdomain flood shares one bucket, ``nxdomains_per_second``;
* any error (REFUSED, FORMERR, SERVFAIL, NOTIMP, BADVERS, …): (network), ``errors_per_second``.

Each bucket is a token balance (BIND's accounting): it regains ``rate`` per second up to
``rate`` (one second's worth of burst), every response costs 1, and a response is limited
while the balance is negative. The debt is capped at ``window`` seconds of the rate, so a
network that stops flooding is answered again within ``window`` seconds.

The table holds at most ``max_buckets`` buckets, least recently used first out, so a flood
from many (spoofed) networks costs bounded memory. A forgotten bucket starts full again,
which only errs toward answering.
"""

from __future__ import annotations

import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

PASS, DROP, SLIP = 0, 1, 2  # actions, also indexes into DnsCounters.rrl_actions
ACTION_NAMES = ("pass", "drop", "slip")

RESPONSE, NXDOMAIN, ERROR = 0, 1, 2  # response classes, each with its own rate


@dataclass(frozen=True, slots=True)
class RrlConfig:
    responses_per_second: float
    nxdomains_per_second: float
    errors_per_second: float
    window: float = 15.0  # seconds of debt a bucket may run up
    slip: int = 2  # every slip-th limited response is a TC=1 reply; 0 drops all, 1 slips all
    ipv4_prefix: int = 24
    ipv6_prefix: int = 56
    max_buckets: int = 100_000

    def rate(self, kind: int) -> float:
        return (self.responses_per_second, self.nxdomains_per_second, self.errors_per_second)[kind]


class _Bucket:
    __slots__ = ("balance", "limited", "stamp")

    def __init__(self, balance: float, stamp: float) -> None:
        self.balance = balance
        self.stamp = stamp
        self.limited = 0  # limited responses so far, for slip


BucketKey = tuple[int, int, bytes, int]  # (network, class, name, qtype)


class RateLimiter:
    """Decides PASS, DROP or SLIP for one UDP response about to be sent."""

    def __init__(self, config: RrlConfig, clock: Callable[[], float] = time.monotonic) -> None:
        if config.responses_per_second <= 0 or config.nxdomains_per_second <= 0 or config.errors_per_second <= 0:
            raise ValueError("every RRL rate must be positive")
        self.config = config
        self.clock = clock
        self.buckets: OrderedDict[BucketKey, _Bucket] = OrderedDict()
        self._v4_shift = 32 - config.ipv4_prefix
        self._v6_shift = 128 - config.ipv6_prefix

    def network(self, source: str) -> int:
        """The client's network as an int: IPv4 networks below 2**32, IPv6 ones above."""
        if ":" not in source:
            return int.from_bytes(socket.inet_aton(source), "big") >> self._v4_shift
        address = source.partition("%")[0]
        if address.startswith("::ffff:") and "." in address:  # IPv4-mapped: the same client as over IPv4
            return int.from_bytes(socket.inet_aton(address[7:]), "big") >> self._v4_shift
        packed = socket.inet_pton(socket.AF_INET6, address)
        return (1 << 128 | int.from_bytes(packed, "big")) >> self._v6_shift

    def check(self, source: str, kind: int, name: bytes = b"", qtype: int = 0) -> int:
        """Account one response of class ``kind`` to ``source``; return PASS, DROP or SLIP.

        ``name`` and ``qtype`` matter only for RESPONSE; for NXDOMAIN pass the zone as ``name``.
        """
        config = self.config
        if kind == RESPONSE:
            key = (self.network(source), kind, name, qtype)
        elif kind == NXDOMAIN:
            key = (self.network(source), kind, name, 0)
        else:
            key = (self.network(source), kind, b"", 0)
        rate = config.rate(kind)
        now = self.clock()
        buckets = self.buckets
        bucket = buckets.get(key)
        if bucket is None:
            bucket = _Bucket(rate, now)
            buckets[key] = bucket
            if len(buckets) > config.max_buckets:
                buckets.popitem(last=False)
        else:
            buckets.move_to_end(key)
            bucket.balance = min(rate, bucket.balance + (now - bucket.stamp) * rate)
            bucket.stamp = now
        balance = bucket.balance - 1
        floor = -config.window * rate
        bucket.balance = balance if balance > floor else floor
        if balance >= 0:
            return PASS
        bucket.limited += 1
        if config.slip and bucket.limited % config.slip == 0:
            return SLIP
        return DROP
