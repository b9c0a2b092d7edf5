"""dns.workers=2: two processes answer on one port (SO_REUSEPORT), both follow the zone, a killed one comes back.

Real worker processes on loopback; every process started here is stopped by PID in teardown.
Queries come from many source ports (a socket each), so the kernel's flow hash spreads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator

import dns.message
import dns.rdatatype
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from region_agent.globaldns.service import ZoneService
from region_agent.globaldns.settings import DnsSettings
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, Region, copy_key, project_key, region_key
from region_agent.state.store import Store
from tests.conftest import wait_for

ZONE = "g.example.com"
QUERIES = 300  # per batch, one source port each


def _store() -> Store:
    store = Store(writer="standalone/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    store.put_many([(region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",), ns_ipv4=("192.0.2.53",))),
                    (region_key("ams1"), Region("ams1", ipv4=("192.0.2.2",)))])
    store.put_many([(project_key(f"p{n}"), Project(f"p{n}", ("sfo1", "ams1"))) for n in range(50)])
    store.put_many([(copy_key(f"p{n}", r), CopyHealth(healthy=True)) for n in range(50) for r in ("sfo1", "ams1")])
    return store


def _ask_many(port: int, name: str, count: int) -> list[set[str] | None]:
    """``count`` A queries for ``name``, each from a new socket (a new source port); the addresses answered."""
    wire = dns.message.make_query(name, dns.rdatatype.A).to_wire()
    out: list[set[str] | None] = []
    for _ in range(count):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(2.0)
            sock.sendto(wire, ("127.0.0.1", port))
            try:
                reply = dns.message.from_wire(sock.recv(4096))
            except TimeoutError:
                out.append(None)
                continue
            out.append({item.address for rrset in reply.answer for item in rrset})
    return out


REGISTRY: dict[int, CollectorRegistry] = {}  # each service's registry, by id


@pytest.fixture
async def service() -> AsyncIterator[ZoneService]:
    registry = CollectorRegistry()
    zone = ZoneService(DnsSettings(zone=ZONE, listen_addresses=("127.0.0.1",), port=0, workers=2), _store(),
                       registry)
    REGISTRY[id(zone)] = registry
    zone.set_health_known()
    await zone.start()
    pids: set[int] = set()
    try:
        assert zone.workers is not None
        pids.update(s.pid for s in zone.workers.slots if s.pid is not None)
        yield zone
        pids.update(s.pid for s in zone.workers.slots if s.pid is not None)
    finally:
        await zone.stop()
        for pid in pids:  # whatever stop() left (it ends them by PID too)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)


def _port(zone: ZoneService) -> int:
    return zone.server.bound[0][1]


async def _answered_by_both(zone: ZoneService, name: str, expected: set[str]) -> tuple[list[int], float]:
    """A batch from many ports: every answer is ``expected`` and both workers answered part of it."""
    workers = zone.workers
    assert workers is not None
    before = workers.answers_by_worker()
    answers = await asyncio.to_thread(_ask_many, _port(zone), name, QUERIES)
    assert all(a == expected for a in answers), [a for a in answers if a != expected][:5]

    def reported() -> bool:
        return sum(workers.answers_by_worker()) - sum(before) >= QUERIES
    await wait_for(reported, timeout=5, interval=0.05, message="the workers report their counts")
    share = [now - then for now, then in zip(workers.answers_by_worker(), before, strict=True)]
    return share, min(share) / QUERIES


async def test_two_workers_answer_and_share_the_load(service: ZoneService) -> None:
    assert service.workers is not None
    pids = {s.pid for s in service.workers.slots}
    assert len(pids) == 2 and os.getpid() not in pids
    share, smallest = await _answered_by_both(service, f"p1.{ZONE}", {"192.0.2.1"})
    print(f"answers per worker of {QUERIES} from {QUERIES} source ports: {share}")
    assert smallest > 0.2, share  # the kernel's hash: about half each
    text = generate_latest(REGISTRY[id(service)]).decode()
    for worker, count in enumerate(share):
        assert f'region_agent_dns_worker_responses_total{{worker="{worker}"}} {float(count)}' in text
    assert "region_agent_dns_workers_up 2.0" in text
    assert 'region_agent_dns_responses_total{qtype="A",rcode="NOERROR"} 300.0' in text  # summed over workers


async def test_a_change_reaches_both_workers(service: ZoneService) -> None:
    assert service.workers is not None
    started = time.monotonic()
    service.store.put(copy_key("p2", "sfo1"), CopyHealth(healthy=False, reason="down"))  # a copy going down
    service.store.put(project_key("fresh"), Project("fresh", ("ams1",)))  # a new project
    await service.compiled()
    await wait_for(service.workers.in_step, timeout=5, interval=0.05, message="both workers acknowledge the new tables")
    reached = time.monotonic() - started
    share, _ = await _answered_by_both(service, f"p2.{ZONE}", {"192.0.2.2"})
    fresh, _ = await _answered_by_both(service, f"fresh.{ZONE}", {"192.0.2.2"})
    print(f"a change reached both workers in {reached * 1000:.0f} ms; answers after it {share} and {fresh}")
    assert min(share) > 0 and min(fresh) > 0 and reached < 2.0


async def test_a_killed_worker_is_restarted_counted_and_shown(service: ZoneService) -> None:
    workers = service.workers
    assert workers is not None
    victim = workers.slots[0]
    old_pid = victim.pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    await wait_for(lambda: any("dns worker 0 down" in p for p in workers.problems()), timeout=5, interval=0.05,
                   message="the problem shows")
    started = time.monotonic()
    await wait_for(lambda: victim.restarts == 1 and victim.pid != old_pid and not workers.problems()
                   and workers.in_step(), timeout=20, interval=0.05, message="the worker restarts")
    print(f"worker 0 restarted in {time.monotonic() - started:.2f} s after it was seen down (pid {old_pid} → "
          f"{victim.pid}), restarts {victim.restarts}")
    share, _ = await _answered_by_both(service, f"p3.{ZONE}", {"192.0.2.1"})
    assert min(share) > 0, share
    text = generate_latest(REGISTRY[id(service)]).decode()
    assert 'region_agent_dns_worker_restarts_total{worker="0"} 1.0' in text
