"""ACME DNS-01 for the zone: signed RFC 2136 UPDATEs write challenge TXT records into the store.

:class:`AcmeUpdates` is what the DNS server calls for an UPDATE (opcode 5) on UDP or TCP:
verify the TSIG (``region_agent.globaldns.acme.tsig``), decide (``region_agent.globaldns.acme.update``),
write the accepted records into the replicated store as the ``acme`` owner (so gossip carries them
to every agent and every agent answers them), and answer — signed when the request was. The zone
compiler turns the records into TXT answers; the serial moves with them.

A record whose delete never comes expires after ``lifetime`` (default 24 h): :meth:`sweep`
deletes it. A global token bucket bounds the work a flood of UPDATEs can cause (TSIG
verification costs ~0.3 ms); past it, REFUSED.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import dns.name
import dns.opcode
import dns.rcode
from prometheus_client import CollectorRegistry, Counter, Gauge

from region_agent.globaldns.acme.tsig import TsigKeyring, UnparseableError, Verdict, respond, verify
from region_agent.globaldns.acme.update import UpdateLimits, ZoneFacts, plan_update
from region_agent.globaldns.tables import ZoneHolder
from region_agent.globaldns.wire import name_from_text
from region_agent.state.model import Challenge, Key, Value, challenge_key
from region_agent.state.store import Store

logger = logging.getLogger("region_agent.dns.acme")
_HEADER = struct.Struct("!HHHHHH")


@dataclass(frozen=True)
class AcmeConfig:
    apex: str
    keyring: TsigKeyring
    writer: str  # acme/<node>
    limits: UpdateLimits = field(default_factory=UpdateLimits)
    lifetime: float = 86_400.0  # seconds a challenge lives without a delete
    updates_per_second: float = 20.0
    burst: int = 40


class AcmeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.updates = Counter("region_agent_dns_updates", "RFC 2136 UPDATEs by result (ok, or why refused)",
                               ["result"], registry=registry)
        self.tsig_failures = Counter("region_agent_dns_tsig_failures", "UPDATEs whose TSIG failed, by error",
                                     ["error"], registry=registry)
        self.challenges = Gauge("region_agent_dns_acme_challenges", "ACME challenge TXT records in the zone",
                                registry=registry)
        self.expired = Counter("region_agent_dns_acme_expired", "Challenge records deleted because they outlived "
                               "their lifetime (their delete never came)", registry=registry)


class AcmeUpdates:
    def __init__(self, store: Store, holder: ZoneHolder, config: AcmeConfig, registry: CollectorRegistry, *,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.holder = holder
        self.config = config
        self.apex = dns.name.from_text(config.apex)
        self.metrics = AcmeMetrics(registry)
        self._clock = clock
        self._monotonic = monotonic
        self._tokens = float(config.burst)
        self._refilled = monotonic()
        # Why this agent must take no write now (a skewed clock: it would be refused everywhere), or None.
        self.gate: Callable[[], str | None] = lambda: None
        self.metrics.challenges.set_function(lambda: sum(len(v) for v in store.challenges.values()))

    def handle(self, data: bytes, source: str | None) -> bytes | None:
        """The response to one UPDATE message (None: not worth an answer)."""
        if not self._take_token():
            self.metrics.updates.labels("rate-limited").inc()
            return _header_only(data, dns.rcode.REFUSED)
        try:
            verified = verify(data, self.config.keyring)
        except UnparseableError as error:
            self.metrics.updates.labels("formerr").inc()
            logger.info("UPDATE from %s: malformed (%s)", source, str(error)[:100])
            return _header_only(data, dns.rcode.FORMERR)
        if verified.message.opcode() != dns.opcode.UPDATE:
            return _header_only(data, dns.rcode.NOTIMP)
        if verified.verdict is not Verdict.OK:
            self.metrics.tsig_failures.labels(verified.verdict.value).inc()
            self.metrics.updates.labels(f"tsig-{verified.verdict.value}").inc()
            logger.warning("UPDATE from %s refused: TSIG %s (key %s)", source, verified.verdict.value,
                           verified.message.keyname)
            return respond(verified, dns.rcode.NOTAUTH)
        refusal = self.gate()
        if refusal is not None:
            self.metrics.updates.labels("not-writable").inc()
            logger.warning("UPDATE from %s key %s refused (SERVFAIL, try another name server): %s", source,
                           verified.message.keyname, refusal)
            return respond(verified, dns.rcode.SERVFAIL)
        plan = plan_update(verified.message, self.apex, self._records(),
                           zone=self._facts(), limits=self.config.limits)
        if plan.rcode == dns.rcode.NOERROR and plan.changes:
            expires = int(self._clock() + self.config.lifetime)
            items: list[tuple[Key, Value | None]] = [
                (challenge_key(name, rdata), Challenge(name, rdata, ttl, expires)) for name, rdata, ttl in plan.adds]
            items += [(challenge_key(name, rdata), None) for name, rdata in plan.removes]
            self.store.put_many(items, writer=self.config.writer)
        self.metrics.updates.labels(plan.reason).inc()
        log = logger.info if plan.rcode == dns.rcode.NOERROR else logger.warning
        log("UPDATE from %s key %s: %s (%d added, %d removed)", source, verified.message.keyname,
            dns.rcode.to_text(dns.rcode.Rcode(plan.rcode)), len(plan.adds), len(plan.removes))
        return respond(verified, plan.rcode)

    def _records(self) -> dict[str, dict[bytes, int]]:
        return {name: {rdata: c.ttl for rdata, c in values.items()} for name, values in self.store.challenges.items()}

    def _facts(self) -> ZoneFacts:
        """Prerequisites about the zone's other names, read from the compiled tables.

        The tables hold rendered answers, not record values: an RRset's existence is known,
        its value is not, so a value-dependent prerequisite on a non-challenge name fails.
        """
        tables = self.holder.tables

        def has_name(name: str) -> bool:
            return tables is not None and name_from_text(name) in tables.nodes

        def rrset(name: str, rdtype: int) -> frozenset[bytes] | None:
            node = None if tables is None else tables.nodes.get(name_from_text(name))
            if node is None or (rdtype not in node.replies and rdtype not in node.dynamic):
                return None
            return frozenset({b"(existing)"})

        return ZoneFacts(has_name, rrset)

    def _take_token(self) -> bool:
        now = self._monotonic()
        rate, burst = self.config.updates_per_second, self.config.burst
        self._tokens = min(float(burst), self._tokens + (now - self._refilled) * rate)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def expired(self, now: float | None = None) -> list[Key]:
        now = self._clock() if now is None else now
        return [challenge_key(name, rdata) for name, values in self.store.challenges.items()
                for rdata, challenge in values.items() if challenge.expires_at <= now]

    def sweep(self) -> int:
        """Delete challenges past their lifetime; returns how many."""
        keys = self.expired()
        if keys:
            self.store.put_many([(key, None) for key in keys], writer=self.config.writer)
            self.metrics.expired.inc(len(keys))
            logger.warning("deleted %d ACME challenge record(s) whose delete never came", len(keys))
        return len(keys)

    async def run_sweeper(self, interval: float = 60.0) -> None:
        while True:
            self.sweep()
            await asyncio.sleep(interval)


def _header_only(data: bytes, rcode: int) -> bytes | None:
    """A bare response echoing the ID and opcode: for messages whose body can not be trusted."""
    if len(data) < 12:
        return None
    query_id, flags = struct.unpack_from("!HH", data)
    if flags & 0x8000:
        return None  # a response: never answer one
    return _HEADER.pack(query_id, 0x8000 | (flags & 0x7800) | rcode, 0, 0, 0, 0)
