"""The UDP listener's Python per datagram, in process: no socket traffic, no kernel, one core.

    python bench/dns_hot_path.py                 # every shape, 400 batches of 16, best of 15
    python bench/dns_hot_path.py --smoke         # a few batches: does every path work?

What ``bench/dns_throughput.py`` can not separate from the kernel: the time
``UdpListener._answer_batch`` takes for a batch already in its receive buffers, per datagram.
A real listener (a UDP socket on 127.0.0.1 that is never sent to) gets each batch written into
its recvmmsg slots and lengths as the kernel would, then answers it; only that call is timed
(``time.perf_counter``), and a shape's figure is the best of ``--repeats`` passes over all its
batches, in µs per datagram, with the bench pinned to ``--cpu``. The passes go by turns over the
shapes, since this VM slows down for seconds at a time.

Shapes, on the zone of the DNS tests (an HA project in three regions): ``hit`` one lower-case
name from the memo; ``hit-0x20`` distinct mixed-case spellings of it (memo hits, case folded);
``hit-0x20-ecs`` the same with an EDNS Client Subnet option; ``miss-0x20`` the spellings with
the memo off (parse, answer, render); ``nxdomain`` random names under the zone (never memoised).
Every pass checks what it timed: each hit shape counts one memo hit per datagram, each other
none, and every datagram gets an answer (the send lengths are set), so a broken path can not
pass for a fast one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import sys
import time

from common import REPO, Results, add_arguments

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import dns.edns  # after the path above: the project's and the tests' packages
import dns.message

from region_agent.globaldns import server as server_module
from region_agent.globaldns.answer import Responder, ResponderLimits
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.tables import ZoneHolder
from tests.globaldns.zones import ALL, ZONE, ha, tables_for, up

SHAPES = ("hit", "hit-0x20", "hit-0x20-ecs", "miss-0x20", "nxdomain")
HITS = {"hit", "hit-0x20", "hit-0x20-ecs"}


def queries(shape: str, count: int, rng: random.Random) -> list[bytes]:
    """``count`` query datagrams of one shape, IDs 0.. in order."""
    out = []
    for qid in range(count):
        name = f"shop.{ZONE}"
        if shape != "hit":
            name = "".join(c.upper() if rng.random() < 0.5 else c for c in name)
        if shape == "nxdomain":
            name = f"{rng.getrandbits(48):012x}.{ZONE}"
        options: list[dns.edns.Option] = [dns.edns.ECSOption("192.0.2.0", 24)] if shape.endswith("ecs") else []
        query = dns.message.make_query(name, "A", use_edns=0, options=options)
        query.id = qid % 65536
        out.append(query.to_wire())
    return out


def load(mmsg: server_module._Mmsg, batch: list[bytes]) -> None:
    """Write a batch into the receive slots as recvmmsg would."""
    for i, wire in enumerate(batch):
        at = i * server_module._SLOT
        mmsg.buffers[at:at + len(wire)] = wire
        mmsg.lengths[i] = len(wire)


class Shape:
    """One shape's listener, responder and batches, kept for every pass."""

    def __init__(self, shape: str, batches: int, size: int) -> None:
        self.shape, self.size = shape, size
        tables = tables_for([ha("shop")], {"shop": up(*ALL)})
        memo = 0 if shape.startswith("miss") else 20_000
        self.responder = Responder(ZoneHolder(tables), DnsCounters(), ResponderLimits(memo_entries=memo))
        rng = random.Random(20261202)
        self.work = [queries(shape, size, rng) for _ in range(batches)]
        # A name in the memo's main pool (a first query, and a second to promote it): the shape's own for
        # the hit shapes; for NXDOMAIN the plain name, so the hitter looks and misses, as in a serving agent.
        primer = self.work[0][0] if shape in HITS else queries("hit", 1, rng)[0]
        for _ in range(2):
            self.responder.respond(primer, "127.0.0.1", tcp=False)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.listener = server_module.UdpListener(self.sock, self.responder)
        if self.listener.mmsg is None:
            raise SystemExit("no recvmmsg here: the batched listener is Linux only")
        self.best = float("inf")

    def one_pass(self) -> None:
        """Every batch once; checks the answers and the memo hits, keeps the best µs per datagram."""
        mmsg, size = self.listener.mmsg, self.size
        assert mmsg is not None
        hits0 = self.responder.counters.memo_hits
        spent = 0.0
        for batch in self.work:
            load(mmsg, batch)
            started = time.perf_counter()
            sent = self.listener._answer_batch(size)
            spent += time.perf_counter() - started
            if sent != size:
                raise SystemExit(f"{self.shape}: {sent} answers to {size} queries")
        queries_done = len(self.work) * size
        hits = self.responder.counters.memo_hits - hits0
        if hits != (queries_done if self.shape in HITS else 0):
            raise SystemExit(f"{self.shape}: {hits} memo hits in {queries_done} queries")
        self.best = min(self.best, spent / queries_done)

    def close(self) -> None:
        self.listener.close()


async def measure(batches: int, size: int, repeats: int) -> list[dict[str, object]]:
    """Pass by pass over every shape (so a slow second of the machine costs each shape a pass, not one
    shape all of them); each shape's best pass."""
    shapes = [Shape(shape, batches, size) for shape in SHAPES]
    try:
        for _ in range(repeats):
            for shape in shapes:
                shape.one_pass()
    finally:
        for shape in shapes:
            shape.close()
    return [{"shape": s.shape, "us_per_datagram": round(s.best * 1e6, 3), "batch": size, "batches": batches,
             "repeats": repeats} for s in shapes]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--batches", type=int, default=400, help="batches per pass")
    parser.add_argument("--batch", type=int, default=16, help="datagrams per batch (at most UDP_BATCH)")
    parser.add_argument("--repeats", type=int, default=15, help="passes per shape; the best counts")
    parser.add_argument("--cpu", type=int, default=1, help="core to pin the bench to (if it has it)")
    add_arguments(parser)
    args = parser.parse_args()
    if not 1 <= args.batch <= server_module.UDP_BATCH or args.batches < 1 or args.repeats < 1:
        parser.error(f"--batch 1..{server_module.UDP_BATCH}, --batches and --repeats at least 1")
    if args.smoke:
        args.batches, args.repeats = 5, 1
    if args.cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {args.cpu})
    with Results("dns_hot_path", args.out, smoke=args.smoke) as results:
        for figures in asyncio.run(measure(args.batches, args.batch, args.repeats)):
            print(f"{figures['shape']:<14} {figures['us_per_datagram']:.3f} µs per datagram (batches of "
                  f"{args.batch})", flush=True)
            results.add(f"shape {figures['shape']}", **figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
