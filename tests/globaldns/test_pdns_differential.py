"""Differential test: region-agent against PowerDNS 4.7 LUA ``ifurlup()`` on the same health endpoints.

One PowerDNS Authoritative 4.7 (bind backend, ``enable-lua-records=shared``,
``lua-health-checks-interval=1``) and one ``python -m agent run`` (standalone zone file,
``checks.interval`` 1 s) are started side by side on free loopback ports. Both check the same
fake copies (:mod:`region_agent.demo.fake_copy`) on 127.0.0.11-14 at one free port:

=========  ==================  ==========================================================
project    agent zone file     PowerDNS record (``selector='all', backupSelector='all'``)
=========  ==================  ==========================================================
shop       sfo1, ams1; sfo1    ``ifurlup(url, {{'127.0.0.11'}, {'127.0.0.12'}}, ...)``
                               (the anchor's record, bench/anchors/pdns)
web        sfo1, ams1, nrt1;   ``ifurlup(url, {{'127.0.0.11'}, {'127.0.0.12', '127.0.0.13',
           sfo1                '127.0.0.14'}}, ...)`` (nrt1 has two addresses: a backup group
                               of several regions, a region of several addresses)
=========  ==================  ==========================================================

Each HA case flips the endpoints, waits until both servers have checked every endpoint after
the flip (PowerDNS at least twice, the agent at least twice: its rule needs two results), then
waits (with a deadline, never a fixed sleep) until both answer, and asserts that both answer the
same A address *set*, the one ifurlup's semantics give, and still do at the next query.

Deliberate differences, so not compared:

* **Failures to flip.** PowerDNS 4.7 ignores ``minimumFailures`` (read only from 5.0 on): one
  failed check takes an address out and one good check brings it back. The agent needs
  ``fall=2`` consecutive failures, the second a quick re-check ``recheck_delay`` (0.1 s) after the
  first, and ``rise=2`` successes to come back. So one lost check flips PowerDNS and never the
  agent; after a real change both end in the same answer (the agent ~0.1 s later than one check).
  Timing is measured in ``bench/failover.py``, not here.
* **Timeout.** The record says ``timeout=2``; the agent refuses a check timeout longer than its
  interval, so at ``checks.interval`` 1 s it runs with ``checks.timeout`` 1 s. No case here
  depends on a timeout between 1 and 2 s (``drop`` closes at once, the start-up ``hang`` is longer
  than both).
* **Cold start.** PowerDNS starts a check only when a LUA record is first queried and answers that
  first query (and every query until the check returns) as if every address were down: every
  group (``backupSelector='all'``). The agent checks every target from boot and until the first
  round is complete answers by ``dns.startup_answer`` (default ``all``: the same set) with
  ``/readyz`` false. Compared in :func:`test_first_answer_before_any_check`, with the primary
  hanging so that the agent's first round can not finish early.
* **Idle expiry.** PowerDNS drops a check not queried for ``lua-health-checks-expire-delay``
  (1 h) and answers every group again on the next query; the agent never stops checking.
* **SOA serial.** PowerDNS serves the zone file's serial; the agent derives it from its state.
  The SOA is otherwise written identical here (MNAME is the agent's default, the first
  ``ns-<region>`` by name), so the other SOA fields, owners, TTLs, flags and rcodes are compared.
* **A dropped connection.** The agent's HTTP client (aiohttp 3.14) retries a GET once when the
  connection closes without an answer, so a single dropped connection fails a PowerDNS check but
  not an agent check. Compared here only for a copy that drops every connection (both: down).
* **Address order** inside an answer is not compared (``selector='all'`` order is not a contract).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import dns.exception
import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from tests.conftest import wait_for_sync
from tests.fakes.dns_client import make_query

# PowerDNS, the agent and the fake copies start as the benches start them (bench/common.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from common import start_agent, start_endpoints, start_pdns, tool_versions
from dns_rig import Endpoint, Procs

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(shutil.which("pdns_server") is None,
                       reason="pdns_server not installed (apt-get install pdns-server pdns-backend-bind)"),
]

ZONE = "g.example.com"
CHECK_HOST = f"runr-health.{ZONE}"
PRIMARY, BACKUP, NRT_A, NRT_B = "127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14"
ENDPOINTS = (PRIMARY, BACKUP, NRT_A, NRT_B)
PROJECTS: Mapping[str, tuple[tuple[str, ...], ...]] = {  # slug -> ifurlup groups
    "shop": ((PRIMARY,), (BACKUP,)),
    "web": ((PRIMARY,), (BACKUP, NRT_A, NRT_B)),
}
PDNS_UA = "PowerDNS"
AGENT_UA = "region-agent"
SETTLE_TIMEOUT = 10.0


# ---------------------------------------------------------------- the rig


class Endpoints:
    """The fake copies, one process each, all on one port (the check URL names one port)."""

    def __init__(self, procs: Procs, hosts: tuple[str, ...]) -> None:
        self.by_host: dict[str, Endpoint] = start_endpoints(procs, "copy", hosts)
        self.port = self.by_host[hosts[0]].port

    def set(self, states: Mapping[str, str]) -> float:
        """Apply behaviours (host -> state text, others 'ok'); returns the epoch after which checks see them."""
        for host, endpoint in self.by_host.items():
            endpoint.set(states.get(host, "ok"))
        return time.time()


def ifurlup_lua(slug: str, groups: tuple[tuple[str, ...], ...], port: int) -> str:
    sets = ", ".join("{" + ", ".join(f"'{a}'" for a in group) + "}" for group in groups)
    return (f"{slug}.{ZONE}. 30 IN LUA A \"ifurlup('http://{CHECK_HOST}:{port}/global-health/{slug}', {{{sets}}}, "
            "{selector='all', backupSelector='all', timeout=2, minimumFailures=2, stringmatch='ok'})\"")


def pdns_zone(port: int) -> str:
    lines = [
        f"$ORIGIN {ZONE}.",
        "$TTL 300",
        # The agent's SOA: MNAME the first ns-<region> by name, TTL 3600, minimum 60.
        f"@ 3600 IN SOA ns-ams1.{ZONE}. hostmaster.{ZONE}. 1 3600 600 604800 60",
        *(f"@ 3600 IN NS ns-{r}.{ZONE}." for r in ("ams1", "nrt1", "sfo1")),
        "ns-ams1 3600 IN A 127.0.0.2",
        "ns-nrt1 3600 IN A 127.0.0.3",
        "ns-sfo1 3600 IN A 127.0.0.1",
        *(ifurlup_lua(slug, groups, port) for slug, groups in PROJECTS.items()),
    ]
    return "\n".join(lines) + "\n"


AGENT_ZONE = """\
regions:
  sfo1: {ipv4: [127.0.0.11], ns_ipv4: [127.0.0.1]}
  ams1: {ipv4: [127.0.0.12], ns_ipv4: [127.0.0.2]}
  nrt1: {ipv4: [127.0.0.13, 127.0.0.14], ns_ipv4: [127.0.0.3]}
projects:
  shop: {regions: [sfo1, ams1], primary: sfo1, mode: ha, all_down: all}
  web: {regions: [sfo1, ams1, nrt1], primary: sfo1, mode: ha, all_down: all}
"""


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def query(self, name: str, rdtype: str = "A", *, edns: bool = True, rd: bool = True) -> dns.message.Message:
        q = make_query(name, rdtype, use_edns=0 if edns else False, flags=dns.flags.RD if rd else 0)
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited ({self.process.returncode}):\n{self.tail()}")
        return dns.query.udp(q, "127.0.0.1", port=self.port, timeout=1.0,
                              ignore_unexpected=True)  # a stray datagram to a reused client port

    def addresses(self, slug: str) -> frozenset[str] | None:
        """The A address set answered for <slug>.<zone>, or None when the query failed."""
        try:
            response = self.query(f"{slug}.{ZONE}")
        except (dns.exception.Timeout, OSError):
            return None
        return frozenset(rr.address for rrset in response.answer if rrset.rdtype == dns.rdatatype.A
                         for rr in rrset)


def ready(port: int) -> bool | None:
    """The agent's /readyz: True, False, or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as response:
            return bool(response.status == 200)
    except urllib.error.HTTPError:
        return False
    except OSError:
        return None


def _checked(endpoint: Endpoint, since: float, ua: str, path: str, count: int) -> Callable[[], bool]:
    def done() -> bool:
        seen = endpoint.checks()  # the requests it has answered so far, from its log
        return sum(r.arrived > since and r.user_agent.startswith(ua) and r.path == path for r in seen) >= count

    return done


@dataclass
class Rig:
    endpoints: Endpoints
    pdns: Server
    agent: Server
    agent_metrics_port: int
    first: dict[str, object] = field(default_factory=dict)
    settled: dict[str, str] | None = None  # the endpoint states both servers were last seen to agree on

    def servers(self) -> tuple[Server, Server]:
        return self.pdns, self.agent

    def settle(self, states: Mapping[str, str], expected: Mapping[str, frozenset[str]]) -> None:
        """Flip the endpoints, wait until both servers have seen it, and compare their answers."""
        since = self.endpoints.set(states)
        for host, endpoint in self.endpoints.by_host.items():
            for slug, groups in PROJECTS.items():
                if not any(host in group for group in groups):
                    continue
                path = f"/global-health/{slug}"
                # PowerDNS 4.7 decides on one check, the agent on two (fall/rise 2 with a quick re-check).
                for ua, count in ((PDNS_UA, 1), (AGENT_UA, 2)):
                    wait_for_sync(_checked(endpoint, since, ua, path, count), timeout=SETTLE_TIMEOUT,
                                  interval=0.02, message=f"{count} {ua} check(s) of {host}{path}")

        def answers() -> dict[str, dict[str, frozenset[str] | None]]:
            return {s.name: {slug: s.addresses(slug) for slug in PROJECTS} for s in self.servers()}

        def agree() -> bool:
            got = answers()
            return all(got[s.name] == dict(expected) for s in self.servers())

        try:
            wait_for_sync(agree, timeout=5, interval=0.05, message="both servers to answer the expected sets")
        except AssertionError:
            raise AssertionError(f"states {dict(states)}: expected {dict(expected)}, got {answers()}") from None
        assert answers() == {s.name: dict(expected) for s in self.servers()}, "answer changed after settling"
        self.settled = dict(states)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    # The expectations below are PowerDNS 4.7's (one failed check flips, minimumFailures ignored).
    version = tool_versions(["pdns_server"])["pdns_server"]
    assert version.startswith("4.7."), f"this test compares against PowerDNS 4.7, found {version}"
    with Procs(tmp_path_factory.mktemp("pdns-differential")) as procs:  # stops every process by PID
        endpoints = Endpoints(procs, ENDPOINTS)
        # The primary hangs (longer than either timeout) so the agent's first round can not finish
        # before the cold-start answers are read.
        endpoints.set({PRIMARY: "hang 4"})
        # Both answer SOA when started; an SOA query starts no LUA check.
        started = start_pdns(procs, "pdns", pdns_zone(endpoints.port), lua="shared", interval=1, loglevel=6)
        pdns = Server("pdns", started.port, started.proc, started.log)
        started = start_agent(procs, "agent", AGENT_ZONE, wait="dns", log_level="info", checks={
            "port": endpoints.port, "interval": 1, "timeout": 1, "recheck_delay": 0.1, "fall": 2, "rise": 2})
        agent = Server("agent", started.port, started.proc, started.log)
        metrics_port = started.metrics_port
        assert metrics_port is not None
        wait_for_sync(lambda: ready(metrics_port) is not None, timeout=10, message="the agent's /readyz")
        agent_first = {slug: agent.addresses(slug) for slug in PROJECTS}
        agent_ready = ready(metrics_port)
        # PowerDNS's very first LUA queries: its checks of each record start now.
        pdns_first = {slug: pdns.addresses(slug) for slug in PROJECTS}
        rig = Rig(endpoints, pdns, agent, metrics_port,
                  {"pdns": pdns_first, "agent": agent_first, "agent_ready": agent_ready})
        rig.settle({}, {"shop": frozenset({PRIMARY}), "web": frozenset({PRIMARY})})
        yield rig


# ---------------------------------------------------------------- tests


def test_first_answer_before_any_check(rig: Rig) -> None:
    every = {"shop": frozenset({PRIMARY, BACKUP}), "web": frozenset(ENDPOINTS)}
    assert rig.first["pdns"] == every, "PowerDNS's first LUA answer is every group"
    assert rig.first["agent_ready"] is False, "the agent must not be ready before its first round"
    assert rig.first["agent"] == every, "the agent's start-up rule (default all) answers every group"


def _set(*addresses: str) -> frozenset[str]:
    return frozenset(addresses)


ALL_WEB = _set(PRIMARY, BACKUP, NRT_A, NRT_B)
HA_CASES: list[tuple[str, dict[str, str], frozenset[str], frozenset[str]]] = [
    # id, endpoint states (others ok), shop answer, web answer
    ("both-up", {}, _set(PRIMARY), _set(PRIMARY)),
    ("primary-down", {PRIMARY: "down"}, _set(BACKUP), _set(BACKUP, NRT_A, NRT_B)),
    ("backup-down", {BACKUP: "down"}, _set(PRIMARY), _set(PRIMARY)),
    ("primary-and-backup-down", {PRIMARY: "down", BACKUP: "down"}, _set(PRIMARY, BACKUP), _set(NRT_A, NRT_B)),
    ("primary-and-one-backup-address-down", {PRIMARY: "down", NRT_A: "down"}, _set(BACKUP),
     _set(BACKUP, NRT_B)),
    ("all-down", dict.fromkeys(ENDPOINTS, "down"), _set(PRIMARY, BACKUP), ALL_WEB),
    ("200-without-ok", {PRIMARY: "200 error"}, _set(BACKUP), _set(BACKUP, NRT_A, NRT_B)),
    ("200-not-ok-is-up", {PRIMARY: "200 not ok"}, _set(PRIMARY), _set(PRIMARY)),
    ("200-OK-uppercase", {PRIMARY: "200 OK"}, _set(BACKUP), _set(BACKUP, NRT_A, NRT_B)),
    ("503-with-body-ok", {PRIMARY: "503 ok"}, _set(BACKUP), _set(BACKUP, NRT_A, NRT_B)),
    ("connection-dropped", {PRIMARY: "drop"}, _set(BACKUP), _set(BACKUP, NRT_A, NRT_B)),
    ("recovery", {}, _set(PRIMARY), _set(PRIMARY)),
]


@pytest.mark.parametrize(("states", "shop", "web"), [c[1:] for c in HA_CASES], ids=[c[0] for c in HA_CASES])
def test_ha_answers_match(rig: Rig, states: dict[str, str], shop: frozenset[str], web: frozenset[str]) -> None:
    rig.settle(states, {"shop": shop, "web": web})


def _shape(response: dns.message.Message) -> dict[str, object]:
    def rrsets(section: list[dns.rrset.RRset]) -> list[tuple[str, str, int, frozenset[str]]]:
        out = []
        for rrset in section:
            texts = frozenset(
                " ".join(rr.to_text().split()[:2] + rr.to_text().split()[3:]) if rrset.rdtype == dns.rdatatype.SOA
                else rr.to_text() for rr in rrset)  # SOA without its serial
            out.append((rrset.name.to_text(), dns.rdatatype.to_text(rrset.rdtype), rrset.ttl, texts))
        return sorted(out)

    return {
        "rcode": dns.rcode.to_text(response.rcode()),
        "flags": dns.flags.to_text(response.flags),
        "answer": rrsets(response.answer),
        "authority": rrsets(response.authority),
        "additional": rrsets(response.additional),
        "edns": (response.edns, response.payload if response.edns >= 0 else None),
    }


@pytest.mark.parametrize(("name", "rdtype", "edns", "rd"), [
    (f"shop.{ZONE}", "A", True, True),  # the HA answer: flags qr aa rd, TTL 30
    (f"shop.{ZONE}", "A", False, False),  # no EDNS, no RD
    (f"web.{ZONE}", "A", True, True),
    (f"shop.{ZONE}", "AAAA", True, True),  # NODATA with the SOA (TTL = min(SOA TTL, minimum) = 60)
    (f"nope.{ZONE}", "A", True, True),  # NXDOMAIN with the SOA
    (f"nope.{ZONE}", "AAAA", False, True),
    (ZONE, "NS", True, True),  # NS with glue
    (ZONE, "SOA", True, True),
    (f"ns-sfo1.{ZONE}", "A", True, True),
    ("example.org", "A", True, True),  # outside the zone: REFUSED
], ids=["ha-A", "ha-A-noedns-nord", "web-A", "ha-AAAA-nodata", "nxdomain", "nxdomain-AAAA-noedns", "apex-NS",
        "apex-SOA", "glue-A", "out-of-zone"])
def test_response_shapes_match(rig: Rig, name: str, rdtype: str, edns: bool, rd: bool) -> None:
    if rig.settled != {}:
        rig.settle({}, {"shop": frozenset({PRIMARY}), "web": frozenset({PRIMARY})})
    pdns = _shape(rig.pdns.query(name, rdtype, edns=edns, rd=rd))
    agent = _shape(rig.agent.query(name, rdtype, edns=edns, rd=rd))
    assert agent == pdns
