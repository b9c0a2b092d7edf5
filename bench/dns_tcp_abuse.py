"""DNS over TCP abuse: clients that pipeline queries and never read; RSS and UDP latency meanwhile.

Reproduces the first finding of issue 7 on loopback: ``--clients`` TCP clients each send their
share of ``--queries`` pipelined queries as fast as the server takes them and read nothing.
A client whose connection the server closes (idle timeout) connects again and goes on, as an
attacker would. Meanwhile a UDP prober sends ``--probe-rate`` queries per second and times them.
Each server (the agent, and PowerDNS 4.7 beside it unless ``--no-pdns``) gets the same abuse, one
after the other, and the bench prints per server:

- RSS before, at its peak during the abuse and after it, from ``/proc/<pid>/status``;
- queries the clients got into the kernel (not all are read by the server: that is the point);
- UDP p50/p99 and losses before and during the abuse.

Bounded: at most ``--queries`` per server and ``--seconds`` of abuse; nothing leaves 127.0.0.0/8;
every process started is stopped by PID when the bench ends.

    python bench/dns_tcp_abuse.py                   # 1,000,000 queries, 4 clients, agent and PowerDNS
    python bench/dns_tcp_abuse.py --no-pdns --queries 200000 --seconds 20
    python bench/dns_tcp_abuse.py --smoke           # seconds: proves it runs, measures nothing

Results also go to a JSON lines file (``--out``; see ``bench/common.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results, add_arguments
from dns_rig import (
    HA_NAME,
    PRIMARY,
    Procs,
    Server,
    busy_percent,
    free_port,
    need_tools,
    start_agent,
    start_endpoint,
    start_pdns,
    wait_answer,
)


def query_wire(name: str, qid: int, rdtype: int = 1) -> bytes:
    """A plain query (RD set, no EDNS) built by hand: the bench needs nothing beyond the stdlib."""
    labels = b"".join(bytes([len(part)]) + part.encode("ascii") for part in name.rstrip(".").split("."))
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\x00" + struct.pack("!HH", rdtype, 1)


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


@dataclass
class Probe:
    """UDP queries at a fixed rate, each waited for up to 1 s; round-trip times in seconds."""

    port: int
    rate: float
    rtts: list[float] = field(default_factory=list)
    lost: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.settimeout(1.0)
        sock.connect(("127.0.0.1", self.port))
        interval = 1.0 / self.rate
        qid = 0
        next_at = time.monotonic()
        try:
            while not self.stop.is_set():
                qid = (qid + 1) & 0xFFFF
                sent = time.monotonic()
                sock.send(query_wire(HA_NAME, qid))
                try:
                    while True:  # skip a late answer to an earlier query
                        data = sock.recv(4096)
                        if len(data) >= 2 and struct.unpack_from("!H", data)[0] == qid:
                            self.rtts.append(time.monotonic() - sent)
                            break
                except TimeoutError:
                    self.lost += 1
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    self.stop.wait(delay)
                else:
                    next_at = time.monotonic()
        finally:
            sock.close()


@dataclass
class Abuser:
    """One client: pipelines its share of queries and never reads; reconnects when closed.

    It keeps its connection open until the deadline even once all its queries are sent.
    """

    port: int
    share: int
    deadline: float
    sent: int = 0
    connections: int = 0
    batch: bytes = b""

    def run(self) -> None:
        per_batch = 1000
        self.batch = b"".join(struct.pack("!H", len(q)) + q
                              for q in (query_wire(HA_NAME, i) for i in range(per_batch)))
        sock: socket.socket | None = None
        pending = memoryview(self.batch)
        while self.sent < self.share and time.monotonic() < self.deadline:
            if sock is None:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
                sock.settimeout(0.2)
                self.connections += 1
                pending = memoryview(self.batch)
            try:
                count = sock.send(pending)
                pending = pending[count:]
                if not pending:
                    self.sent += per_batch
                    pending = memoryview(self.batch)
            except TimeoutError:
                continue  # the server has stopped reading us: keep the pressure on until the deadline
            except OSError:
                sock.close()  # closed by the server (idle timeout): come back, as an attacker would
                sock = None
        # All sent: hold the connection, still reading nothing, while the server works through it.
        while sock is not None and time.monotonic() < self.deadline:
            time.sleep(0.1)
        if sock is not None:
            sock.close()


@dataclass
class Outcome:
    name: str
    rss_before: int
    rss_peak: int
    rss_after: int
    sent: int
    connections: int
    seconds: float
    base_rtts: list[float]
    base_lost: int
    rtts: list[float]
    lost: int


def measure(server: Server, *, queries: int, clients: int, seconds: float, probe_rate: float,
            baseline: float) -> Outcome:
    base = Probe(server.port, probe_rate)
    thread = threading.Thread(target=base.run, daemon=True)
    thread.start()
    time.sleep(baseline)
    base.stop.set()
    thread.join()
    rss_before = rss_bytes(server.pid)
    probe = Probe(server.port, probe_rate)
    probe_thread = threading.Thread(target=probe.run, daemon=True)
    started = time.monotonic()
    abusers = [Abuser(server.port, queries // clients, started + seconds) for _ in range(clients)]
    threads = [threading.Thread(target=a.run, daemon=True) for a in abusers]
    probe_thread.start()
    for t in threads:
        t.start()
    peak = rss_before
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_bytes(server.pid))
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    peak = max(peak, rss_bytes(server.pid))
    probe.stop.set()
    probe_thread.join()
    for t in threads:
        t.join()
    time.sleep(1.0)  # let the server notice the closed connections
    return Outcome(server.name, rss_before, peak, rss_bytes(server.pid), sum(a.sent for a in abusers),
                   sum(a.connections for a in abusers), elapsed, base.rtts, base.lost, probe.rtts, probe.lost)


def latency(rtts: list[float], lost: int) -> dict[str, object]:
    """p50/p99 in ms (None without answers), answered and lost probes."""
    return {"p50_ms": round(percentile(rtts, 50) * 1e3, 3) if rtts else None,
            "p99_ms": round(percentile(rtts, 99) * 1e3, 3) if rtts else None,
            "answered": len(rtts), "lost": lost}


def show(o: Outcome) -> None:
    mb = 1 << 20
    print(f"{o.name}: {o.sent:,} queries sent by the clients in {o.seconds:.1f} s over {o.connections} connections")
    print(f"  RSS before {o.rss_before / mb:.1f} MB, peak {o.rss_peak / mb:.1f} MB "
          f"(+{(o.rss_peak - o.rss_before) / mb:.1f} MB), after {o.rss_after / mb:.1f} MB")
    for label, rtts, lost in (("before", o.base_rtts, o.base_lost), ("during", o.rtts, o.lost)):
        figures = latency(rtts, lost)
        print(f"  UDP {label}: p50 {figures['p50_ms']} ms, p99 {figures['p99_ms']} ms, lost {lost}/{len(rtts) + lost}",
              flush=True)


def tcp_metrics(port: int) -> dict[str, float]:
    """The agent's ``region_agent_dns_tcp_*`` series (closes, refusals, read pauses) from its operator port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        print(f"  (no metrics from port {port}: {exc})")
        return {}
    series = {}
    for line in text.splitlines():
        if line.startswith("region_agent_dns_tcp_") and "_created" not in line:
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--queries", type=int, default=1_000_000, help="queries per server, all clients together")
    parser.add_argument("--clients", type=int, default=4, help="never-reading TCP clients")
    parser.add_argument("--seconds", type=float, default=40.0, help="abuse stops after this long at the latest")
    parser.add_argument("--probe-rate", type=float, default=200.0, help="UDP probe queries per second")
    parser.add_argument("--baseline", type=float, default=5.0, help="seconds of UDP probing before the abuse")
    parser.add_argument("--no-pdns", action="store_true", help="the agent only")
    add_arguments(parser)
    args = parser.parse_args()
    if args.smoke:  # proves the bench runs; PowerDNS only where it is installed
        args.queries, args.seconds, args.baseline, args.probe_rate = 20_000, 3.0, 1.0, 50.0
        args.no_pdns = args.no_pdns or shutil.which("pdns_server") is None
    if not (1_000 <= args.queries <= 10_000_000 and 1 <= args.clients <= 64 and 1 <= args.seconds <= 300
            and 1 <= args.probe_rate <= 5_000 and 0 < args.baseline <= 60):
        parser.error("--queries 1e3..1e7, --clients 1..64, --seconds 1..300, --probe-rate 1..5000, "
                     "--baseline 0..60")
    tools = ("dig", *(() if args.no_pdns else ("pdns_server",)))
    need_tools(*tools)
    tmp = Path(tempfile.mkdtemp(prefix="dns-tcp-abuse."))
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  cores: {len(os.sched_getaffinity(0))}  "
          f"tmp: {tmp}")
    print(f"background before start: {busy_percent(1 if args.smoke else 3):.0f}% of all cores busy "
          "(other users of this machine)")
    print(f"abuse: {args.clients} clients, {args.queries:,} pipelined '{HA_NAME} A' queries at most, "
          f"{args.seconds:.0f} s at most; UDP probe {args.probe_rate:.0f}/s", flush=True)
    with Results("dns_tcp_abuse", args.out, smoke=args.smoke, tools=tools) as results, Procs(tmp) as procs:
        health_port = free_port(("127.0.0.11", "127.0.0.12"), udp=False)
        start_endpoint(procs, "copy-sfo1", "127.0.0.11", health_port)
        start_endpoint(procs, "copy-ams1", "127.0.0.12", health_port)
        operator_port = free_port(udp=False)  # /metrics
        servers = [start_agent(procs, "agent", health_port,
                               env={"REGION_AGENT_HEALTH__OPERATOR_PORT": str(operator_port)})]
        if not args.no_pdns:
            servers.append(start_pdns(procs, "pdns", health_port, lua="shared"))
        for server in servers:
            wait_answer(server, PRIMARY, 30)
            print(f"{server.name}: pid {server.pid}, port {server.port}, {server.notes}", flush=True)
        for server in servers:
            o = measure(server, queries=args.queries, clients=args.clients, seconds=args.seconds,
                        probe_rate=args.probe_rate, baseline=args.baseline)
            show(o)
            counters = tcp_metrics(operator_port) if server.name == "agent" else {}
            for name, value in counters.items():
                print(f"  {name} {value:g}")
            mb = 1 << 20
            results.add("server", server=server.name, clients=args.clients, queries_sent=o.sent,
                        connections=o.connections, seconds=round(o.seconds, 1),
                        rss_before_mb=round(o.rss_before / mb, 1), rss_peak_mb=round(o.rss_peak / mb, 1),
                        rss_after_mb=round(o.rss_after / mb, 1),
                        rss_growth_mb=round((o.rss_peak - o.rss_before) / mb, 1),
                        udp_before=latency(o.base_rtts, o.base_lost), udp_during=latency(o.rtts, o.lost),
                        tcp_counters=counters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
