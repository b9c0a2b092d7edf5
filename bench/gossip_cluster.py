"""Real agent processes in one gossip cluster on loopback, N = 3, 5, 20, 50: the scenarios of the
Serf anchor (``../shared/bench/anchors/serf/run.sh``) measured on ``region-agent run``.

For each N, agents are started by :class:`tests.e2e.fleet.Fleet` (node ``n<i>``, regions cycling
over five, one fake copy per region, agent 0 imports the zone file and is every other agent's
seed, one keyring, the same TSIG key everywhere, gossip preset ``lan``, anti-entropy every
``--sync-interval`` s, checks every 0.5 s with fall 2). Then, in this order:

a. **join**: from launching the processes until every agent's ``region_agent_gossip_members
   {state="alive"}`` is N (also from the last agent's operator listener answering: Python start-up
   on two cores is most of the first figure).
e. **steady**: after ``--settle`` s, an idle window of ``--idle`` s with no polling at all: CPU
   (utime+stime from ``/proc/<pid>/stat``) per agent per minute, and gossip payload bytes/s per
   agent from ``region_agent_gossip_bytes_total`` (sent and received; the payload the gossip layer
   counts, without IP/UDP/TCP/TLS headers, unlike the anchor's nft L3 counts).
b. **acme**: ``--updates`` times, an RFC 2136 add as cert-manager sends it (HMAC-MD5, TTL 60) to
   agent 0, then from just before sending until every agent's TXT answer holds the value; then its
   delete (class NONE) until it is gone everywhere.
c. **copy_down**: ``--flips`` times, one region's copy answers ``down`` until no agent answers its
   address for ``shop`` (from the flip, and from the first agent to drop it, which is when its
   region's store write happened, to the last); then ``ok`` until every agent answers it again.
d. **kill**: ``--kills`` times, ``kill -9`` of the highest-numbered live agent until every survivor
   counts one alive member fewer and none suspect (first and last survivor).

DNS answers are polled over one UDP socket every ``--dns-poll`` s per agent (the time an agent
first answered is that reply's arrival), the metrics every ``--metrics-poll`` s per agent, one
HTTP request each. p95 is the nearest rank (of 10 samples: the largest). ``--serf RESULTS.jsonl``
(the anchor's ``results/<stamp>/results.jsonl``) adds one ``ratio`` line per N the two share.

    python bench/gossip_cluster.py                      # N = 3 5 20 50, ~12 min on 2 cores
    python bench/gossip_cluster.py --sizes 3 5 20 --serf ../shared/bench/anchors/serf/results/<stamp>/results.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Foreign, Results, add_arguments
from dns_rig import cpu_seconds

KEY_SECRET = base64.b64encode(b"gossip-cluster-bench-0123456789a").decode()
Predicate = Callable[[bytes], bool]


# ---------------------------------------------------------------- figures


def p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def summary(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0}
    return {"count": len(values), "median_s": round(statistics.median(values), 3), "p95_s": round(p95(values), 3),
            "min_s": round(min(values), 3), "max_s": round(max(values), 3),
            "all_s": [round(v, 3) for v in values]}


def spread(start: float, times: Sequence[float | None]) -> dict[str, Any]:
    """The per-agent times of one event (None: never) relative to ``start``."""
    seen = [t - start for t in times if t is not None]
    return {"missing": sum(1 for t in times if t is None),
            "all_s": round(max(seen), 3) if seen and len(seen) == len(times) else None,
            "first_s": round(min(seen), 3) if seen else None,
            "median_agent_s": round(statistics.median(seen), 3) if seen else None}


# ---------------------------------------------------------------- DNS polling over one socket


class DnsPoller(asyncio.DatagramProtocol):
    """Sends one query to each agent per round; a reply that meets the predicate marks its agent."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self._pending: dict[int, tuple[int, Predicate, list[float | None]]] = {}
        self._id = 0
        self.sent = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)   # uvloop's is not a subclass

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        entry = self._pending.pop(int.from_bytes(data[:2], "big"), None)
        if entry is not None:
            index, predicate, done = entry
            if done[index] is None and predicate(data):
                done[index] = time.monotonic()

    async def until(self, targets: Sequence[tuple[str, int]], wire: bytes, predicate: Predicate, *,
                    interval: float, timeout: float) -> list[float | None]:
        """Per target: when it first answered ``wire`` with a reply meeting ``predicate`` (None: never)."""
        assert self.transport is not None
        done: list[float | None] = [None] * len(targets)
        deadline = time.monotonic() + timeout
        while None in done and time.monotonic() < deadline:
            for index, target in enumerate(targets):
                if done[index] is None:
                    self._id = (self._id + 1) & 0xFFFF
                    self._pending[self._id] = (index, predicate, done)
                    self.transport.sendto(self._id.to_bytes(2, "big") + wire[2:], target)
                    self.sent += 1
            await asyncio.sleep(interval)   # the polling pace
        self._pending.clear()
        return done


def rcode(reply: bytes) -> int:
    return reply[3] & 0x0F


def ancount(reply: bytes) -> int:
    return int.from_bytes(reply[6:8], "big")


def holds(mark: bytes) -> Predicate:
    return lambda reply: mark in reply


def lacks(mark: bytes) -> Predicate:
    """An answer (NOERROR or NXDOMAIN) without ``mark``."""
    return lambda reply: rcode(reply) in (0, 3) and mark not in reply


def answers_without(mark: bytes) -> Predicate:
    """Some answer records, none of them ``mark``."""
    return lambda reply: ancount(reply) > 0 and mark not in reply


def a_rdata(address: str) -> bytes:
    return b"\x00\x04" + socket.inet_aton(address)   # RDLENGTH 4 and the address: an A record's tail


# ---------------------------------------------------------------- metrics polling


@dataclass
class Gauges:
    alive: float = 0.0
    suspect: float = 0.0
    sent_bytes: float = 0.0
    received_bytes: float = 0.0
    sent_messages: float = 0.0
    sent_by_type: dict[str, float] = field(default_factory=dict)   # bytes sent, by message type


def parse_metrics(text: str) -> Gauges:
    g = Gauges()
    for line in text.splitlines():
        if not line.startswith("region_agent_gossip_"):
            continue
        head, _, value = line.rpartition(" ")
        if head == 'region_agent_gossip_members{state="alive"}':
            g.alive = float(value)
        elif head == 'region_agent_gossip_members{state="suspect"}':
            g.suspect = float(value)
        elif head.startswith("region_agent_gossip_bytes_total{"):
            if 'direction="sent"' in head:
                g.sent_bytes += float(value)
                kind = head.partition('type="')[2].partition('"')[0]
                g.sent_by_type[kind] = g.sent_by_type.get(kind, 0.0) + float(value)
            else:
                g.received_bytes += float(value)
        elif head.startswith("region_agent_gossip_messages_total{") and 'direction="sent"' in head:
            g.sent_messages += float(value)
    return g


class Scraper:
    def __init__(self) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        self.requests = 0

    async def gauges(self, host: str, port: int) -> Gauges | None:
        self.requests += 1
        try:
            async with self.session.get(f"http://{host}:{port}/metrics") as response:
                if response.status != 200:
                    return None
                return parse_metrics(await response.text())
        except (self._aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def until(self, agents: Sequence[Any], predicate: Callable[[Gauges], bool], *, interval: float,
                    timeout: float) -> tuple[list[float | None], list[float | None]]:
        """Per agent: when its listener first answered, and when its gauges first met ``predicate``."""
        up: list[float | None] = [None] * len(agents)
        met: list[float | None] = [None] * len(agents)
        deadline = time.monotonic() + timeout

        async def one(index: int, agent: Any) -> None:
            while time.monotonic() < deadline:
                if agent.process is not None and agent.process.poll() is not None:
                    tail = agent.log.read_text(encoding="utf-8", errors="replace")[-1500:]
                    raise RuntimeError(f"agent n{agent.index} exited with {agent.process.returncode}:\n{tail}")
                g = await self.gauges(agent.host, agent.operator_port)
                now = time.monotonic()
                if g is not None:
                    up[index] = up[index] or now
                    if predicate(g):
                        met[index] = now
                        return
                await asyncio.sleep(interval)   # the polling pace

        await asyncio.gather(*(one(i, a) for i, a in enumerate(agents)))
        return up, met

    async def close(self) -> None:
        await self.session.close()


# ---------------------------------------------------------------- one cluster size


@dataclass
class Plan:
    updates: int
    flips: int
    kills: int
    idle: float
    settle: float
    sync_interval: float
    dns_poll: float
    metrics_poll: float
    keep_tmp: bool
    join_timeout: float


async def run_size(n: int, plan: Plan, results: Results) -> None:
    from region_agent.gossip.keyring import generate_key
    from tests.e2e.cluster import APEX
    from tests.e2e.fleet import Fleet, Tsig, copy_address

    tmp = Path(tempfile.mkdtemp(prefix=f"gossip-cluster-{n}-"))
    fleet = Fleet(tmp)
    loop = asyncio.get_running_loop()
    _, poller = await loop.create_datagram_endpoint(DnsPoller, local_addr=("127.0.0.1", 0))
    scraper = Scraper()
    dns_poll = plan.dns_poll * max(1.0, n / 20)     # keep the query rate at most ~1,000/s
    metrics_poll = plan.metrics_poll * max(1.0, n / 20)
    try:
        agents = await fleet.build(n, key=generate_key(), tsig=Tsig("cert-manager", "hmac-md5", KEY_SECRET),
                                   sync_interval=plan.sync_interval, log_level="warning")
        regions = len(fleet.copies)
        print(f"N={n}: starting {n} agents ({regions} regions) in {tmp}", flush=True)

        # a. join
        t0 = time.monotonic()
        for agent in agents:
            agent.start()
        launched = time.monotonic() - t0
        up, alive = await scraper.until(agents, lambda g: g.alive == n, interval=metrics_poll,
                                        timeout=plan.join_timeout)
        if None in alive:   # recorded, and this size ends here (the machine could not carry it)
            counts = [g.alive if g is not None else None
                      for g in [await scraper.gauges(a.host, a.operator_port) for a in agents]]
            results.add("join", n=n, converged=False, timeout_s=plan.join_timeout,
                        listeners_up=sum(1 for t in up if t is not None), agents_at_n=n - alive.count(None),
                        alive_counts_at_timeout=counts, launch_s=round(launched, 3))
            print(f"N={n}: no convergence in {plan.join_timeout} s; alive counts {counts}", flush=True)
            return
        up_times = [t for t in up if t is not None]
        alive_times = [t for t in alive if t is not None]
        join = {"n": n, "converged": True, "launch_s": round(launched, 3),
                "all_alive_from_launch_s": round(max(alive_times) - t0, 3),
                "last_listener_up_s": round(max(up_times) - t0, 3),
                "all_alive_from_last_listener_up_s": round(max(alive_times) - max(up_times), 3),
                "agent_alive_after_own_listener_median_s": round(statistics.median(
                    a - u for a, u in zip(alive_times, up_times, strict=True)), 3),
                "metrics_poll_s": metrics_poll}
        results.add("join", **join)
        print(f"N={n}: join {join}", flush=True)

        targets = [(a.host, a.dns_port) for a in agents]
        import dns.message

        shop = dns.message.make_query(f"shop.{APEX}", "A").to_wire()
        every_copy = [a_rdata(copy_address(r)) for r in range(regions)]
        answered = await poller.until(targets, shop, lambda d: all(c in d for c in every_copy), interval=0.1,
                                      timeout=60)
        if None in answered:
            raise RuntimeError(f"N={n}: {answered.count(None)} agents never answered every copy; logs in {tmp}")

        # e. steady state: nothing polls
        await asyncio.sleep(plan.settle)   # the agents' first anti-entropy rounds and check cycles pass
        pids = [a.process.pid for a in agents if a.process is not None]
        before = [await scraper.gauges(a.host, a.operator_port) for a in agents]
        cpu0 = [cpu_seconds(pid) for pid in pids]
        w0 = time.monotonic()
        with Foreign(pids) as foreign:
            await asyncio.sleep(plan.idle)     # the idle window itself
        window = time.monotonic() - w0
        cpu1 = [cpu_seconds(pid) for pid in pids]
        after = [await scraper.gauges(a.host, a.operator_port) for a in agents]
        cpu_min = [(c1 - c0) * 60 / window for c0, c1 in zip(cpu0, cpu1, strict=True)]
        pairs = [(b, a) for b, a in zip(before, after, strict=True) if b is not None and a is not None]
        sent = [(a.sent_bytes - b.sent_bytes) / window for b, a in pairs]
        received = [(a.received_bytes - b.received_bytes) / window for b, a in pairs]
        messages = [(a.sent_messages - b.sent_messages) / window for b, a in pairs]
        rss = [_rss_mb(pid) for pid in pids]
        kinds = sorted({kind for _, a in pairs for kind in a.sent_by_type})
        by_type = {kind: round(statistics.median((a.sent_by_type.get(kind, 0.0) - b.sent_by_type.get(kind, 0.0))
                                                 / window for b, a in pairs)) for kind in kinds} if pairs else {}
        steady = {
            "n": n, "window_s": round(window, 1), "settle_s": plan.settle, "sync_interval_s": plan.sync_interval,
            "cpu_seconds_per_agent_per_minute": _stats(cpu_min, 3),
            "cpu_percent_per_agent_median": round(statistics.median(cpu_min) / 60 * 100, 2),
            "cpu_percent_all_agents": round(sum(cpu_min) / 60 * 100, 2),
            "sent_bytes_per_s_per_agent": _stats(sent, 0),
            "sent_bytes_per_s_per_agent_by_type_median": by_type,
            "received_bytes_per_s_per_agent": _stats(received, 0),
            "sent_messages_per_s_per_agent": _stats(messages, 2),
            "rss_mb_per_agent": _stats(rss, 1),
            "cluster_sent_bytes_per_s": round(sum(sent)),
            "foreign_busy_percent": foreign.percent,
        }
        results.add("steady", **steady)
        print(f"N={n}: steady {steady}", flush=True)

        # b. ACME: add at agent 0, answered by every agent; delete, gone everywhere
        import dns.update

        adds: list[float] = []
        deletes: list[float] = []
        per_agent: list[float] = []
        missing = 0
        for rep in range(plan.updates):
            token = f"bench-{n}-{rep}-{os.urandom(4).hex()}"
            query = dns.message.make_query(f"_acme-challenge.{APEX}", "TXT").to_wire()
            for action in ("add", "delete"):
                wire = _cert_manager_update(APEX, action, token)
                predicate = holds(token.encode()) if action == "add" else lacks(token.encode())
                start = time.monotonic()
                await _send_update(agents[0].host, agents[0].dns_port, wire)
                seen = await poller.until(targets, query, predicate, interval=dns_poll, timeout=15)
                times = [t - start for t in seen if t is not None]
                missing += len(seen) - len(times)
                if len(times) == len(seen):
                    (adds if action == "add" else deletes).append(max(times))
                    if action == "add":
                        per_agent.extend(times)
        add, delete = summary(adds), summary(deletes)
        results.add("acme", n=n, target="n0", add=add, delete=delete,
                    add_per_agent_median_s=round(statistics.median(per_agent), 3) if per_agent else None,
                    agents_never_seen=missing, dns_poll_s=dns_poll)
        print(f"N={n}: acme add {_short(add)}; delete {_short(delete)}", flush=True)

        # c. a copy goes down (its region's agents write it), out of every agent's answers; then back
        from_flip: list[float] = []
        store_spread: list[float] = []
        back: list[float] = []
        missing = 0
        for rep in range(plan.flips):
            region = (1 + rep) % regions
            mark = a_rdata(copy_address(region))
            start = time.monotonic()
            fleet.copies[region].set("down")
            seen = await poller.until(targets, shop, answers_without(mark), interval=dns_poll, timeout=20)
            missing += seen.count(None)
            if None not in seen:
                times = [t for t in seen if t is not None]
                from_flip.append(max(times) - start)
                store_spread.append(max(times) - min(times))
            start = time.monotonic()
            fleet.copies[region].set("ok")
            seen = await poller.until(targets, shop, holds(mark), interval=dns_poll, timeout=20)
            missing += seen.count(None)
            if None not in seen:
                back.append(max(t for t in seen if t is not None) - start)
        down, down_spread = summary(from_flip), summary(store_spread)
        results.add("copy_down", n=n, down_from_flip=down, down_first_to_last_agent=down_spread,
                    up_from_flip=summary(back), agents_never_seen=missing, check_interval_s=0.5, check_fall=2,
                    dns_poll_s=dns_poll)
        print(f"N={n}: copy down from flip {_short(down)}; first->last agent {_short(down_spread)}", flush=True)

        # d. kill -9: every survivor counts one alive member fewer
        live = list(agents)
        first_all: list[tuple[float, float]] = []
        for _ in range(min(plan.kills, n - 2)):
            victim = live.pop()
            start = time.monotonic()
            victim.kill()
            expected = len(live)
            _, met = await scraper.until(live, alive_exactly(expected), interval=metrics_poll, timeout=60)
            seen_times = [t - start for t in met if t is not None]
            first = round(min(seen_times), 3) if seen_times else None
            last = round(max(seen_times), 3) if len(seen_times) == expected else None
            results.add("kill", n=n, victim=f"n{victim.index}", survivors=expected, first_s=first, all_s=last,
                        missing=expected - len(seen_times), metrics_poll_s=metrics_poll)
            print(f"N={n}: kill n{victim.index}: first survivor {first} s, all {last} s", flush=True)
            if first is not None and last is not None:
                first_all.append((first, last))
        if first_all:
            results.add("kill_summary", n=n, first=summary([f for f, _ in first_all]),
                        all=summary([a for _, a in first_all]))
        results.add("load", n=n, dns_queries_sent=poller.sent, metrics_requests=scraper.requests)
    finally:
        await scraper.close()
        if poller.transport is not None:
            poller.transport.close()
        await fleet.stop()
        if not plan.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def alive_exactly(expected: int) -> Callable[[Gauges], bool]:
    """The victim is neither alive nor suspect here: it is dead (or already forgotten)."""
    return lambda g: g.alive == expected and g.suspect == 0


def _stats(values: Sequence[float], digits: int) -> dict[str, float]:
    if not values:
        return {}
    return {"median": round(statistics.median(values), digits), "mean": round(statistics.fmean(values), digits),
            "max": round(max(values), digits)}


def _short(s: dict[str, Any]) -> str:
    return f"median {s.get('median_s')} s p95 {s.get('p95_s')} s (n={s.get('count')})"


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _cert_manager_update(zone: str, action: str, value: str) -> bytes:
    """As cert-manager's RFC 2136 solver sends it: add with TTL 60, delete-RR (class NONE), HMAC-MD5."""
    import dns.tsig
    import dns.tsigkeyring
    import dns.update

    update = dns.update.UpdateMessage(zone)
    if action == "add":
        update.add(f"_acme-challenge.{zone}.", 60, "TXT", f'"{value}"')
    else:
        update.delete(f"_acme-challenge.{zone}.", "TXT", f'"{value}"')
    update.use_tsig(dns.tsigkeyring.from_text({"cert-manager": (dns.tsig.HMAC_MD5, KEY_SECRET)}),
                    keyname="cert-manager", fudge=300, algorithm=dns.tsig.HMAC_MD5)
    return update.to_wire()


async def _send_update(host: str, port: int, wire: bytes) -> None:
    """Send the signed UPDATE as it is; the reply's rcode must be NOERROR (its TSIG is not checked)."""
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[bytes] = loop.create_future()

    class Client(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
            if not reply.done():
                reply.set_result(data)

    transport, _ = await loop.create_datagram_endpoint(Client, remote_addr=(host, port))
    try:
        transport.sendto(wire)
        data = await asyncio.wait_for(reply, 2)
    finally:
        transport.close()
    if rcode(data) != 0:
        raise RuntimeError(f"UPDATE refused: rcode {rcode(data)}")


# ---------------------------------------------------------------- Serf side by side


def serf_ratios(path: Path, ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per N measured on both sides: the anchor's medians and ours / Serf's."""
    by_n: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for text in path.read_text(encoding="utf-8").splitlines():
        line = json.loads(text)
        by_n.setdefault(int(line["n"]), {}).setdefault(line["scenario"], []).append(line["data"])
    lines = []
    for n, serf in sorted(by_n.items()):
        mine = {line["name"]: line for line in ours if line.get("n") == n}
        if not mine:
            continue

        def med(scenario: str, key: str, serf: dict[str, list[dict[str, Any]]] = serf) -> float | None:
            values = []
            for data in serf.get(scenario, []):
                value: Any = data
                for part in key.split("."):   # "cpu_pct.median": a nested figure
                    value = value.get(part) if isinstance(value, dict) else None
                if value is not None:
                    values.append(float(value))
            return statistics.median(values) if values else None

        pairs: dict[str, tuple[float | None, float | None]] = {
            "failure_all_s": (mine["kill_summary"]["all"].get("median_s") if "kill_summary" in mine else None,
                              med("fail", "all_s")),
            "failure_first_s": (mine["kill_summary"]["first"].get("median_s") if "kill_summary" in mine else None,
                                med("fail", "first_s")),
            "dissemination_all_s (acme add vs serf event -coalesce=false)": (
                mine["acme"]["add"].get("median_s") if "acme" in mine else None, med("dissem.nocoalesce", "all_s")),
            "store_change_all_s (copy down, first->last agent vs serf event -coalesce=false)": (
                mine["copy_down"]["down_first_to_last_agent"].get("median_s") if "copy_down" in mine else None,
                med("dissem.nocoalesce", "all_s")),
            "join_cold_all_s (from last listener up vs serf rpc up)": (
                mine["join"].get("all_alive_from_last_listener_up_s") if "join" in mine else None,
                _serf_join_after_ready(serf)),
            "cpu_percent_per_agent": (mine["steady"]["cpu_percent_per_agent_median"] if "steady" in mine else None,
                                      med("steady", "cpu_pct.median")),
            "bytes_per_s_per_agent (ours payload sent, serf L3 sent)": (
                mine["steady"]["sent_bytes_per_s_per_agent"].get("median") if "steady" in mine else None,
                med("steady", "bytes_per_s_per_agent")),
        }
        figures = {name: {"ours": a, "serf": b, "ratio": round(a / b, 2) if a is not None and b else None}
                   for name, (a, b) in pairs.items()}
        lines.append({"n": n, "serf_results": str(path), **figures})
    return lines


def _serf_join_after_ready(serf: dict[str, list[dict[str, Any]]]) -> float | None:
    cold = serf.get("join.cold", [])
    if not cold or cold[0].get("all_s") is None or cold[0].get("rpc_ready_all_s") is None:
        return None
    return float(cold[0]["all_s"]) - float(cold[0]["rpc_ready_all_s"])


# ---------------------------------------------------------------- main


async def run(args: argparse.Namespace, results: Results) -> None:
    plan = Plan(updates=args.updates, flips=args.flips, kills=args.kills, idle=args.idle, settle=args.settle,
                sync_interval=args.sync_interval, dns_poll=args.dns_poll, metrics_poll=args.metrics_poll,
                keep_tmp=args.keep_tmp, join_timeout=args.join_timeout)
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)   # the finally blocks stop every agent by PID
    for n in args.sizes:
        start = time.monotonic()
        with Foreign([]) as foreign:   # the agents are waited-for children by its end: their CPU is ours
            await run_size(n, plan, results)
        results.add("size_wall", n=n, seconds=round(time.monotonic() - start, 1),
                    foreign_busy_percent=foreign.percent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 5, 20, 50])
    parser.add_argument("--updates", type=int, default=10, help="ACME add+delete pairs per N")
    parser.add_argument("--flips", type=int, default=10, help="copy down+up flips per N")
    parser.add_argument("--kills", type=int, default=3, help="kill -9 per N (at most N-2)")
    parser.add_argument("--idle", type=float, default=30.0, help="steady-state window, s")
    parser.add_argument("--settle", type=float, default=15.0, help="wait after convergence before the window, s")
    parser.add_argument("--sync-interval", type=float, default=10.0, help="gossip.sync_interval (agent default)")
    parser.add_argument("--dns-poll", type=float, default=0.02, help="DNS poll interval per agent at N<=20, s")
    parser.add_argument("--metrics-poll", type=float, default=0.1, help="/metrics poll per agent at N<=20, s")
    parser.add_argument("--serf", type=Path, default=None, help="the Serf anchor's results.jsonl, for ratios")
    parser.add_argument("--join-timeout", type=float, default=180.0,
                        help="s from launch for every agent to count N alive; past it the size is recorded as "
                             "not converged and skipped")
    parser.add_argument("--keep-tmp", action="store_true", help="keep configs and agent logs")
    add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.updates, args.flips, args.kills, args.idle, args.settle = [3], 2, 1, 1, 2.0, 1.0
    with Results("gossip_cluster", args.out, smoke=args.smoke) as results:
        asyncio.run(run(args, results))
        if args.serf is not None:
            ours = [line for line in (json.loads(t) for t in results.path.read_text().splitlines())
                    if line.get("type") == "result"]
            for line in serf_ratios(args.serf, ours):
                results.add("ratio", **line)
                print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
