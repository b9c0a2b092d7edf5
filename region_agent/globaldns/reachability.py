"""Is this agent's name server reachable from outside, and does the parent zone delegate to us?

Two checks, run as a resolver would run them, off the answer path (dnspython's client):

* **Reachability**: ask each of this agent's public name-server addresses for the zone's SOA over
  UDP and over TCP (port 53 unless set). A transport is *reachable* when every address answers
  it with an authoritative NOERROR SOA of the zone within the timeout; a load balancer or
  firewall that passes only one of UDP and TCP 53 shows as the other transport failing.
* **Delegation** (with ``reachability.resolver`` set): ask that resolver for the zone's NS set
  and compare it with the expected one (``ns-<region>.<zone>`` of every region with a
  name-server address): ``ok``, ``partial`` (some names missing), ``missing``; ``unknown``
  when the resolver gives no usable answer. A referral from the parent's own server (NS in
  the authority section) counts as its answer, so the resolver may be the parent's server.

:class:`ReachabilityMonitor` runs both every ``interval``; a round with a failure is repeated
sooner, on a backoff from ``timeout`` up to ``interval``. Results go to metrics
(``region_agent_dns_reachable{transport}``, ``region_agent_dns_delegation{state}``) and failed
transports to the agent's degraded problems.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from region_agent.base.clock import Backoff
from region_agent.globaldns.delegation import DelegationState, delegation_state

logger = logging.getLogger("region_agent.reachability")
TRANSPORTS = ("udp", "tcp")


class ReachabilitySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool | None = Field(
        default=None,
        description="Run the reachability and delegation checks. Unset: on in Kubernetes mode (kubernetes: true), "
        "off in standalone mode, whose zone files often name documentation addresses.")
    public_addresses: list[str] = Field(
        default_factory=list,
        description="The public addresses of this agent's name server, as resolvers reach it (a load balancer's). "
        "Empty: this region's name-server addresses in the state (ns_ipv4, ns_ipv6).")
    port: int = Field(default=53, ge=1, le=65535, description="The DNS port asked on the public addresses.")
    interval: float = Field(default=60.0, gt=0, description="Seconds between rounds of checks.")
    timeout: float = Field(default=3.0, gt=0, description="Seconds one query may take (per address and transport).")
    resolver: str | None = Field(
        default=None,
        description="A resolver to check the delegation with, as address or address:port ([v6]:port); port 53 by "
        "default. Unset: no delegation check.")

    @field_validator("public_addresses")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        return [str(ipaddress.ip_address(a)) for a in value]

    @field_validator("resolver")
    @classmethod
    def _resolver(cls, value: str | None) -> str | None:
        if value is not None:
            parse_endpoint(value)
        return value

    @model_validator(mode="after")
    def _timeout_within_interval(self) -> ReachabilitySettings:
        if self.timeout > self.interval:
            raise ValueError(f"timeout {self.timeout} must not exceed interval {self.interval}")
        return self

    def active(self, kubernetes: bool) -> bool:
        return self.enabled if self.enabled is not None else kubernetes

    def resolver_endpoint(self) -> tuple[str, int] | None:
        return None if self.resolver is None else parse_endpoint(self.resolver)


def parse_endpoint(text: str, default_port: int = 53) -> tuple[str, int]:
    """``address``, ``address:port`` or ``[v6 address]:port`` → (address, port); ValueError names the problem."""
    text = text.strip()
    host, port = text, default_port
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: write an IPv6 address with a port as [address]:port")
        if rest:
            port = _port(rest[1:], text)
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _port(port_text, text)
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        raise ValueError(f"{text!r}: not an IP address (a resolver is named by address, not host name)") from None
    return address, port


def _port(text: str, whole: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{whole!r}: port must be 1..65535")
    return int(text)


# --- the checks ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransportResult:
    address: str
    transport: str  # udp or tcp
    ok: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class DelegationResult:
    state: DelegationState
    seen: frozenset[str] = frozenset()  # NS names the resolver gave, without the final dot
    error: str = ""


def _soa_problem(response: dns.message.Message, zone: dns.name.Name) -> str:
    """Why ``response`` is not an authoritative SOA answer for ``zone`` ('' when it is)."""
    rcode = response.rcode()
    if rcode != dns.rcode.NOERROR:
        return f"answered {dns.rcode.to_text(rcode)}"
    if not response.flags & dns.flags.AA:
        return "answered without the authoritative (AA) flag"
    if response.flags & dns.flags.TC:
        return ""  # a truncated answer came over UDP: the transport works
    if not any(rrset.rdtype == dns.rdatatype.SOA and rrset.name == zone for rrset in response.answer):
        return "answered without the zone's SOA"
    return ""


async def check_transport(address: str, zone: str, transport: str, *, port: int, timeout: float) -> TransportResult:
    """One SOA query for ``zone`` to ``address``:``port`` over ``transport``."""
    name = dns.name.from_text(zone)
    query = dns.message.make_query(name, dns.rdatatype.SOA)
    query.flags &= ~dns.flags.RD
    try:
        if transport == "udp":
            response = await dns.asyncquery.udp(query, address, port=port, timeout=timeout, ignore_unexpected=True)
        elif transport == "tcp":
            response = await dns.asyncquery.tcp(query, address, port=port, timeout=timeout)
        else:
            raise ValueError(f"unknown transport {transport!r}")
    except dns.exception.Timeout:
        return TransportResult(address, transport, False, f"no answer within {timeout:g} s")
    except EOFError:
        return TransportResult(address, transport, False, "connection closed without an answer")
    except OSError as exc:  # asyncio's "Connect call failed (...)" says less than the errno does
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        return TransportResult(address, transport, False, f"{type(exc).__name__}: {reason}")
    except dns.exception.DNSException as exc:
        return TransportResult(address, transport, False, f"bad answer: {exc}")
    problem = _soa_problem(response, name)
    return TransportResult(address, transport, not problem, problem)


async def check_reachability(addresses: Iterable[str], zone: str, *, port: int = 53,
                             timeout: float = 3.0) -> list[TransportResult]:
    """Every address over every transport, concurrently; in address then transport order."""
    checks = [check_transport(a, zone, t, port=port, timeout=timeout) for a in addresses for t in TRANSPORTS]
    return list(await asyncio.gather(*checks))


async def check_delegation(resolver: tuple[str, int], zone: str, expected: Iterable[str], *,
                           timeout: float = 3.0) -> DelegationResult:
    """Ask ``resolver`` for the NS set of ``zone`` (UDP, TCP if truncated) and compare it with ``expected``."""
    name = dns.name.from_text(zone)
    query = dns.message.make_query(name, dns.rdatatype.NS)
    address, port = resolver
    try:
        response, _tcp = await dns.asyncquery.udp_with_fallback(query, address, port=port, timeout=timeout)
    except dns.exception.Timeout:
        return DelegationResult(DelegationState.UNKNOWN, error=f"resolver {address}:{port}: no answer within "
                                f"{timeout:g} s")
    except (OSError, EOFError, dns.exception.DNSException) as exc:
        return DelegationResult(DelegationState.UNKNOWN, error=f"resolver {address}:{port}: {type(exc).__name__}: "
                                f"{exc}")
    rcode = response.rcode()
    if rcode not in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
        return DelegationResult(DelegationState.UNKNOWN,
                                error=f"resolver {address}:{port} answered {dns.rcode.to_text(rcode)}")
    # A recursive resolver answers the NS set; the parent's own server refers (NS in authority).
    seen = frozenset(rdata.target.to_text(omit_final_dot=True).lower()
                     for section in (response.answer, response.authority)
                     for rrset in section if rrset.rdtype == dns.rdatatype.NS and rrset.name == name
                     for rdata in rrset)
    error = "" if rcode == dns.rcode.NOERROR else f"resolver {address}:{port} answered NXDOMAIN"
    return DelegationResult(delegation_state(expected, seen), seen, error)


# --- the periodic task ---------------------------------------------------------------


class ReachabilityMonitor:
    """Runs the checks every interval, keeps the last results, exports them."""

    def __init__(self, settings: ReachabilitySettings, *, zone: str, own_addresses: Callable[[], Sequence[str]],
                 expected_ns: Callable[[], Iterable[str]], registry: CollectorRegistry) -> None:
        self.settings = settings
        self.zone = zone
        self._own_addresses = own_addresses
        self._expected_ns = expected_ns
        self.transports: list[TransportResult] = []
        self.delegation: DelegationResult | None = None
        self.rounds = 0
        self.checked_at: float | None = None  # wall clock of the last round that checked an address
        self._backoff = Backoff(initial=settings.timeout, cap=settings.interval, jitter=0.5,
                                reset_after=settings.interval * 4)
        self._reachable = Gauge("region_agent_dns_reachable",
                                "1 when every public name-server address of this agent answers the zone's SOA "
                                "over the transport", ["transport"], registry=registry)
        self._delegation = Gauge("region_agent_dns_delegation",
                                 "1 for the state of the parent zone's delegation as the configured resolver sees it",
                                 ["state"], registry=registry)
        self._errors = Counter("region_agent_dns_reachability_failures_total",
                               "Failed reachability (udp, tcp) and delegation checks", ["check"], registry=registry)
        self._last_success = Gauge("region_agent_dns_reachability_last_success_timestamp_seconds",
                                   "When a round of reachability checks last passed completely", registry=registry)

    def addresses(self) -> list[str]:
        return list(self.settings.public_addresses) or list(self._own_addresses())

    async def check_once(self) -> bool:
        """One round; True when nothing failed."""
        addresses = self.addresses()
        failed = False
        transports: list[TransportResult] = []
        if not addresses and self.rounds == 0:
            logger.warning("reachability not checked: no public_addresses set and this region has no name-server "
                           "address in the state (ns_ipv4, ns_ipv6) yet")
        if addresses:
            transports = await check_reachability(addresses, self.zone, port=self.settings.port,
                                                  timeout=self.settings.timeout)
            for transport in TRANSPORTS:
                results = [r for r in transports if r.transport == transport]
                ok = all(r.ok for r in results)
                self._reachable.labels(transport).set(1 if ok else 0)
                if not ok:
                    self._errors.labels(transport).inc()
                    failed = True
        delegation = None
        resolver = self.settings.resolver_endpoint()
        if resolver is not None:
            delegation = await check_delegation(resolver, self.zone, self._expected_ns(),
                                                timeout=self.settings.timeout)
            for state in DelegationState:
                self._delegation.labels(state.value).set(1 if state is delegation.state else 0)
            if delegation.state is not DelegationState.OK:
                self._errors.labels("delegation").inc()
                failed = True
        self._log_changes(transports, delegation)
        self.transports, self.delegation = transports, delegation
        self.rounds += 1
        if transports:
            self.checked_at = time.time()
        if not failed and (addresses or resolver is not None):  # a round that checked nothing is no success
            self._last_success.set(time.time())
        return not failed

    def _log_changes(self, transports: list[TransportResult], delegation: DelegationResult | None) -> None:
        before = {(r.address, r.transport): r.ok for r in self.transports}
        for result in transports:
            if before.get((result.address, result.transport), True) != result.ok or (
                    self.rounds == 0 and not result.ok):
                if result.ok:
                    logger.info("dns reachable again over %s at %s:%d", result.transport, result.address,
                                self.settings.port)
                else:
                    logger.warning("dns not reachable over %s at %s:%d: %s", result.transport, result.address,
                                   self.settings.port, result.error)
        if delegation is not None and (self.delegation is None or self.delegation.state is not delegation.state):
            log = logger.info if delegation.state is DelegationState.OK else logger.warning
            log("delegation of %s: %s (names seen: %s)%s", self.zone, delegation.state.value,
                ", ".join(sorted(delegation.seen)) or "none", f"; {delegation.error}" if delegation.error else "")

    def summary(self) -> dict[str, Any]:
        """``reachable`` for the region view: true, false, or null (not checked yet, no address).

        ``failed_transports`` names udp and/or tcp when some address did not answer over it;
        ``errors`` (one line per failed address and transport) is for operators only.
        """
        checked = bool(self.transports)
        failed = sorted({r.transport for r in self.transports if not r.ok}, key=TRANSPORTS.index)
        return {
            "reachable": (not failed) if checked else None,
            "failed_transports": failed,
            "addresses": sorted({r.address for r in self.transports}),
            "port": self.settings.port,
            "checked_at": self.checked_at,
            "errors": list(self.problems()),
        }

    def problems(self) -> tuple[str, ...]:
        """One line per address and transport that failed in the last round (for the degraded view)."""
        return tuple(f"dns not reachable over {r.transport} at {r.address}:{self.settings.port}: {r.error}"
                     for r in self.transports if not r.ok)

    def member_meta(self) -> str:
        """The ``dns-reachable`` value this agent gossips in its member metadata, so ``region-agent
        members`` shows a load balancer that drops UDP or TCP 53 anywhere in the cluster:
        ``yes``, ``no:<transports>`` or ``unknown`` (no round finished yet)."""
        summary = self.summary()
        if summary["reachable"] is None:
            return "unknown"
        return "yes" if summary["reachable"] else "no:" + ",".join(summary["failed_transports"])

    async def run(self) -> None:
        while True:
            if await self.check_once():
                self._backoff.reset()
                delay = self.settings.interval
            else:
                delay = max(self.settings.timeout, self._backoff.next_delay(time.monotonic()))
            await asyncio.sleep(delay)
