"""ACME DNS-01 for the zone: signed RFC 2136 UPDATEs write challenge TXT records into the store.

:class:`AcmeUpdates` is what the DNS server calls for an UPDATE (opcode 5) on UDP or TCP:
verify the TSIG (``region_agent.globaldns.acme.tsig``), decide (``region_agent.globaldns.acme.update``),
write the accepted records into the replicated store as the ``acme`` owner (so gossip carries them
to every agent and every agent answers them), and answer — signed when the request was. The zone
compiler turns the records into TXT answers; the serial moves with them.

A TSIG-signed QUERY (certbot's SOA lookup) comes here too and is answered as the answer path
would, signed (RFC 8945 §5.3). Budgets (``limits``) are charged after verification, so unsigned
junk never spends a signed client's; a verified message is taken once (``replay``).

A record whose delete never comes expires after ``lifetime`` (default 24 h): :meth:`sweep`
deletes it.
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

from region_agent.globaldns.acme.limits import UpdateBudgets
from region_agent.globaldns.acme.replay import CAPACITY as REPLAY_CAPACITY
from region_agent.globaldns.acme.replay import ReplayCache, Seen
from region_agent.globaldns.acme.tsig import (
    Peek,
    TsigKeyring,
    UnparseableError,
    Verdict,
    Verified,
    peek,
    respond,
    sign_wire,
    strip_tsig,
    tsig_size,
    verify,
)
from region_agent.globaldns.acme.update import UpdateLimits, ZoneFacts, plan_update
from region_agent.globaldns.answer import SERVFAIL_REPLY, answer, max_response_size, render
from region_agent.globaldns.tables import ZoneHolder
from region_agent.globaldns.wire import MessageError, error_response, name_from_text, parse_query
from region_agent.state.model import Challenge, Key, Value, challenge_key
from region_agent.state.store import Store

logger = logging.getLogger("region_agent.dns.acme")
_HEADER = struct.Struct("!HHHHHH")
DEFAULT_PAYLOAD = 1232  # the answer path's; the Responder passes its own


@dataclass(frozen=True)
class AcmeConfig:
    apex: str
    keyring: TsigKeyring
    writer: str  # acme/<node>
    limits: UpdateLimits = field(default_factory=UpdateLimits)
    lifetime: float = 86_400.0  # seconds a challenge lives without a delete
    updates_per_second: float = 20.0
    burst: int = 40
    replay_capacity: int = REPLAY_CAPACITY


class AcmeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.updates = Counter("region_agent_dns_updates", "RFC 2136 UPDATEs by result (ok, or why refused)",
                               ["result"], registry=registry)
        self.tsig_failures = Counter("region_agent_dns_tsig_failures", "UPDATEs whose TSIG failed, by error",
                                     ["error"], registry=registry)
        self.challenges = Gauge("region_agent_dns_acme_challenges", "ACME challenge TXT records in the zone",
                                registry=registry)
        self.limited = Counter("region_agent_dns_update_limited", "UPDATEs and signed queries refused by a "
                               "budget: unverified (unsigned, bad TSIG, replays), key, source", ["budget"],
                               registry=registry)
        self.replays = Counter("region_agent_dns_tsig_replays", "Signed messages refused because their MAC was "
                               "taken already (a replay within the fudge window)", registry=registry)
        self.signed_queries = Counter("region_agent_dns_signed_queries", "TSIG-signed QUERYs by result (ok: "
                                      "answered and signed, or why refused)", ["result"], registry=registry)
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
        self.budgets = UpdateBudgets(config.updates_per_second, config.burst, monotonic=monotonic)
        self.replays = ReplayCache(capacity=config.replay_capacity, clock=clock)
        # Why this agent must take no write now (a skewed clock: it would be refused everywhere), or None.
        self.gate: Callable[[], str | None] = lambda: None
        self.metrics.challenges.set_function(lambda: sum(len(v) for v in store.challenges.values()))

    def handle(self, data: bytes, source: str | None, *, tcp: bool = False,
               our_payload: int = DEFAULT_PAYLOAD, later: object = None) -> bytes | None:
        """The response to an UPDATE, or to a TSIG-signed QUERY (None: not worth an answer); always at
        once, so ``later`` (``answer.UpdateHandler``) is not used.

        Cheap checks first: a message that names no key of ours is charged to the unverified
        budget before it is parsed. Only a verified, fresh message reaches the key and source
        budgets, so junk never spends them.
        """
        where = peek(data)
        known = where is not None and where.keyname is not None and where.keyname in self.config.keyring.keys
        if not known and not self.budgets.take_unverified():
            return self._limited("unverified", data)
        try:
            verified = verify(data, self.config.keyring, now=self._clock())
        except UnparseableError as error:
            if known and not self.budgets.take_unverified():   # junk naming our key: it costs a parse too
                return self._limited("unverified", data)
            self.metrics.updates.labels("formerr").inc()
            logger.info("UPDATE from %s: malformed (%s)", source, str(error)[:100])
            return header_only(data, dns.rcode.FORMERR)
        opcode = verified.message.opcode()
        if opcode not in (dns.opcode.UPDATE, dns.opcode.QUERY):
            return header_only(data, dns.rcode.NOTIMP)
        if verified.verdict is not Verdict.OK:
            if known and not self.budgets.take_unverified():
                return self._limited("unverified", data)
            return self._tsig_failed(verified, source)
        refusal = self._admit(verified, data, source)
        if refusal is not None:
            return refusal
        if opcode == dns.opcode.QUERY:
            if where is None:  # dnspython read it but the walk did not: nothing to strip the TSIG from
                return header_only(data, dns.rcode.FORMERR)
            return self._signed_query(verified, data, where, source, tcp=tcp, our_payload=our_payload)
        return self._update(verified, source)

    def _tsig_failed(self, verified: Verified, source: str | None) -> bytes:
        self.metrics.tsig_failures.labels(verified.verdict.value).inc()
        self._count(verified, f"tsig-{verified.verdict.value}")
        logger.warning("%s from %s refused: TSIG %s (key %s)", _what(verified), source, verified.verdict.value,
                       verified.message.keyname)
        return respond(verified, dns.rcode.NOTAUTH)

    def _admit(self, verified: Verified, data: bytes, source: str | None) -> bytes | None:
        """None to go on; else the refusal: a replay, a full replay cache, or a spent key or source budget."""
        message = verified.message
        assert message.keyname is not None and message.tsig is not None
        keyname = message.keyname.to_text()
        seen = self.replays.check(keyname, message.mac or b"", message.tsig[0].time_signed)
        if seen is Seen.REPLAY:
            self.metrics.replays.inc()
            if not self.budgets.take_unverified():  # a replay costs what junk costs, never the key's budget
                return self._limited("unverified", data)
            self._count(verified, "replay")
            logger.warning("%s from %s key %s refused: a replay (this MAC was taken already)", _what(verified),
                           source, keyname)
            return respond(verified, dns.rcode.REFUSED)
        if seen is Seen.FULL:
            self._count(verified, "replay-cache-full")
            logger.warning("%s from %s key %s refused: the replay cache is full", _what(verified), source, keyname)
            return respond(verified, dns.rcode.REFUSED)
        spent = self.budgets.take_signed(keyname, source)
        if spent is not None:
            self.metrics.limited.labels(spent).inc()
            self._count(verified, f"limited-{spent}")
            return respond(verified, dns.rcode.REFUSED)
        return None

    def _limited(self, budget: str, data: bytes) -> bytes | None:
        """Past the unverified budget: a bare REFUSED, nothing parsed and nothing logged."""
        self.metrics.limited.labels(budget).inc()
        self.metrics.updates.labels(f"limited-{budget}").inc()
        return header_only(data, dns.rcode.REFUSED)

    def _count(self, verified: Verified, result: str) -> None:
        family = self.metrics.signed_queries if verified.message.opcode() == dns.opcode.QUERY else self.metrics.updates
        family.labels(result).inc()

    def _signed_query(self, verified: Verified, data: bytes, where: Peek, source: str | None, *, tcp: bool,
                      our_payload: int) -> bytes | None:
        """The answer the query would get unsigned, signed with its key over its MAC (RFC 8945 §5.3)."""
        key = verified.key
        assert key is not None
        try:
            query = parse_query(strip_tsig(data, where))
        except MessageError as error:
            body = error_response(error, our_payload=our_payload)
            self._count(verified, "formerr")
        else:
            tables = self.holder.tables
            reply = SERVFAIL_REPLY if tables is None else answer(tables, query, source)
            room = max_response_size(query, tcp=tcp, our_payload=our_payload) - tsig_size(key)
            body = render(query, reply, max_size=room, our_payload=our_payload)
            self._count(verified, "ok")
        if body is None:
            return None
        return sign_wire(body, key, verified.message.mac or b"", original_id=verified.message.id,
                         now=int(self._clock()))

    def _update(self, verified: Verified, source: str | None) -> bytes:
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


def header_only(data: bytes, rcode: int) -> bytes | None:
    """A bare response echoing the ID and opcode: for messages whose body can not be trusted."""
    if len(data) < 12:
        return None
    query_id, flags = struct.unpack_from("!HH", data)
    if flags & 0x8000:
        return None  # a response: never answer one
    return _HEADER.pack(query_id, 0x8000 | (flags & 0x7800) | rcode, 0, 0, 0, 0)


def _what(verified: Verified) -> str:
    return "signed QUERY" if verified.message.opcode() == dns.opcode.QUERY else "UPDATE"
