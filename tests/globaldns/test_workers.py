"""dns.workers=2: two processes answer on one port (SO_REUSEPORT), both follow the zone, a killed one comes back.

Real worker processes on loopback; every process started here is stopped by PID in teardown.
Queries come from many source ports (a socket each), so the kernel's flow hash spreads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import pickle
import signal
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import dns.message
import dns.rcode
import dns.rdatatype
import dns.update
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from region_agent.globaldns import server as server_module
from region_agent.globaldns import service as zone_service
from region_agent.globaldns.acme.service import header_only
from region_agent.globaldns.answer import Responder
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.server import DnsServer, UdpListener, udp_socket
from region_agent.globaldns.service import ZoneService
from region_agent.globaldns.settings import DnsSettings
from region_agent.globaldns.tables import ZoneHolder, ZoneTables
from region_agent.globaldns.worker_main import Forwarder, ForwardTable, Worker
from region_agent.globaldns.workers import FRAME, DnsWorkers, Slot, forward_budget, frame
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, Region, copy_key, project_key, region_key
from region_agent.state.store import Store
from tests.conftest import wait_for
from tests.globaldns.zones import ha, tables_for, up

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


async def _stop(zone: ZoneService, pids: Iterable[int | None]) -> None:
    """Stop the zone, then end by PID whatever worker it left (stop() ends them by PID too)."""
    await zone.stop()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            if pid is not None:
                os.kill(pid, signal.SIGKILL)


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
        await _stop(zone, pids)


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


# --- UPDATE forwarding: asynchronous, bounded, timed out ---------------------------------------------------

def _update_wire() -> bytes:
    return dns.update.UpdateMessage(ZONE).to_wire()


def _answer_header(data: bytes) -> bytes | None:
    return header_only(data, dns.rcode.NOERROR)


def test_the_forward_table_bounds_what_is_in_flight_and_drops_what_times_out() -> None:
    table = ForwardTable(limit=2, timeout=1.0)
    got: list[bytes | None] = []
    first, second = table.begin(got.append, now=10.0), table.begin(got.append, now=10.5)
    assert first is not None and second is not None
    assert table.begin(got.append, now=10.6) is None   # two in flight: the third is refused
    assert table.next_deadline() == 11.0
    assert table.expire(10.9) == 0
    assert table.expire(11.0) == 1                     # the first is dropped at its deadline
    assert table.complete(first, b"late") is None      # its answer, after: nobody waits for it
    reply = table.complete(second, b"answer")
    assert reply is not None
    reply(b"answer")
    assert got == [b"answer"] and not table.pending
    assert dict(table.stats) == {"forwarded": 2, "busy": 1, "timeout": 1, "late": 1, "answered": 1}


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
async def test_a_receive_slots_address_is_the_senders_as_sendto_takes_it(host: str) -> None:
    """What ``UdpListener.later`` sends to: the datagram's sender, port included, for either family."""
    listener = UdpListener(udp_socket(host, 0), Responder(ZoneHolder(), DnsCounters()))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        if listener.mmsg is None:
            pytest.skip("no recvmmsg here")
        asyncio.get_running_loop().remove_reader(listener.fd)  # read by hand below
        senders = [socket.socket(family, socket.SOCK_DGRAM) for _ in range(3)]
        for sender in senders:
            sender.bind((host, 0))
            sender.sendto(b"x" * 12, listener.sock.getsockname())
        count = 0
        deadline = time.monotonic() + 2
        while count < 3 and time.monotonic() < deadline:
            count += max(0, listener_recv(listener, count))
        assert count == 3
        got = [listener.mmsg.address(i)[:2] for i in range(3)]
        assert sorted(got) == sorted(s.getsockname()[:2] for s in senders)
        for sender in senders:
            sender.close()
    finally:
        listener.close()


def listener_recv(listener: UdpListener, start: int) -> int:
    """One recvmmsg into the listener's slots from ``start`` on (the test reads them itself)."""
    assert listener.mmsg is not None and server_module._MMSG is not None
    slots = ctypes.addressof(listener.mmsg.recv) + start * server_module._HDR
    return int(server_module._MMSG[0](listener.fd, slots, 3 - start, 0x40, None))


async def test_a_forward_without_a_way_to_answer_later_is_servfail_at_once() -> None:
    ours, main_end = socket.socketpair()
    forwarder = Forwarder(ours, per_second=100, burst=100)
    try:
        update = _update_wire()
        out = forwarder(update, "127.0.0.1", tcp=False)
        assert out is not None and out[:2] == update[:2] and out[3] & 0x0F == dns.rcode.SERVFAIL
        assert forwarder.table.stats["forwarded"] == 0
    finally:
        forwarder._close(None)
        ours.close()
        main_end.close()


@pytest.fixture
async def forwarding() -> AsyncIterator[tuple[DnsServer, Forwarder, socket.socket]]:
    """A DnsServer in this process whose UPDATEs go to a Forwarder; the main process's end of its socket pair."""
    holder = ZoneHolder()
    holder.replace(tables_for([ha("shop")], {"shop": up("sfo1")}))
    responder = Responder(holder, DnsCounters())
    ours, main_end = socket.socketpair()
    forwarder = Forwarder(ours, per_second=100, burst=100)
    responder.updates = forwarder
    server = DnsServer(responder, [("127.0.0.1", 0)])
    await server.start()
    main_end.settimeout(2.0)
    try:
        yield server, forwarder, main_end
    finally:
        await server.stop()
        forwarder._close(None)
        ours.close()
        main_end.close()


def _forwarded(main_end: socket.socket) -> tuple[int, bytes]:
    (length,) = FRAME.unpack(main_end.recv(4, socket.MSG_WAITALL))
    token, data, _source, _tcp, _payload = pickle.loads(main_end.recv(length, socket.MSG_WAITALL))
    return token, data


async def test_a_udp_forward_is_answered_when_the_main_process_answers_and_dropped_after_the_timeout(
        forwarding: tuple[DnsServer, Forwarder, socket.socket]) -> None:
    server, forwarder, main_end = forwarding
    port = server.bound[0][1]
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        update = _update_wire()
        await loop.sock_sendto(client, update, ("127.0.0.1", port))
        token, data = await asyncio.to_thread(_forwarded, main_end)
        assert data == update and forwarder.table.pending          # waiting, and the loop goes on:
        query = dns.message.make_query(f"shop.{ZONE}", "A")
        await loop.sock_sendto(client, query.to_wire(), ("127.0.0.1", port))
        reply = dns.message.from_wire(await asyncio.wait_for(loop.sock_recv(client, 4096), 2))
        assert reply.id == query.id and reply.answer                 # answered while the UPDATE waits
        main_end.sendall(frame((token, _answer_header(data))))       # the main process answers the UPDATE
        answer = await asyncio.wait_for(loop.sock_recv(client, 4096), 2)
        assert answer[:2] == update[:2] and answer[2] & 0x80         # its ID, a response, to the same port
        assert forwarder.table.stats["answered"] == 1

        forwarder.table.timeout = 0.05                               # one the main process never answers
        await loop.sock_sendto(client, update, ("127.0.0.1", port))
        late, _ = await asyncio.to_thread(_forwarded, main_end)
        await wait_for(lambda: forwarder.table.stats["timeout"] == 1, timeout=2, message="the forward dropped")
        main_end.sendall(frame((late, _answer_header(update))))
        await wait_for(lambda: forwarder.table.stats["late"] == 1, timeout=2, message="the late answer counted")

        forwarder.table.limit, forwarder.table.timeout = 1, 5.0      # one in flight at most
        await loop.sock_sendto(client, update, ("127.0.0.1", port))
        await asyncio.to_thread(_forwarded, main_end)
        await loop.sock_sendto(client, update, ("127.0.0.1", port))
        busy = await asyncio.wait_for(loop.sock_recv(client, 4096), 2)
        assert busy[3] & 0x0F == dns.rcode.SERVFAIL and forwarder.table.stats["busy"] == 1
    finally:
        client.close()


async def test_a_tcp_forward_is_answered_on_its_connection_after_the_queries_behind_it(
        forwarding: tuple[DnsServer, Forwarder, socket.socket]) -> None:
    """RFC 7766 §6.2.1.1: the UPDATE's answer may come after the answers to queries sent after it."""
    server, forwarder, main_end = forwarding
    reader, writer = await asyncio.open_connection("127.0.0.1", server.bound[0][1])
    try:
        update = _update_wire()
        query = dns.message.make_query(f"shop.{ZONE}", "A")
        writer.write(struct.pack("!H", len(update)) + update)
        token, data = await asyncio.to_thread(_forwarded, main_end)
        wire = query.to_wire()
        writer.write(struct.pack("!H", len(wire)) + wire)
        (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 2))
        first = dns.message.from_wire(await reader.readexactly(length))
        assert first.id == query.id and first.answer          # the query behind the UPDATE, first
        main_end.sendall(frame((token, _answer_header(data))))
        (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 2))
        second = await reader.readexactly(length)
        assert second[:2] == update[:2] and second[2] & 0x80  # then the UPDATE's, on the same connection
        assert forwarder.table.stats["answered"] == 1
        assert server.responder.counters.tcp_closed["bad_message"] == 0
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_a_worker_answers_queries_while_its_forward_waits_for_the_main_process() -> None:
    """The main process holds a forwarded UPDATE; the worker that forwarded it answers a query from the same
    client socket (so the same worker) meanwhile, then the UPDATE's answer."""
    zone = ZoneService(DnsSettings(zone=ZONE, listen_addresses=("127.0.0.1",), port=0, workers=2), _store(),
                       CollectorRegistry())
    assert zone.workers is not None
    gate, held = threading.Event(), threading.Event()

    def handler(data: bytes, source: str | None, *, tcp: bool = False, our_payload: int = 1232) -> bytes | None:
        held.set()
        gate.wait(5.0)   # the main process busy (its loop held) until the client has its other answer
        return _answer_header(data)

    zone.workers._updates = lambda: handler
    zone.set_health_known()
    await zone.start()
    pids = [s.pid for s in zone.workers.slots]
    try:
        port = _port(zone)

        def client() -> tuple[float, bytes, bytes]:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                try:
                    sock.settimeout(3.0)
                    update = _update_wire()
                    sock.sendto(update, ("127.0.0.1", port))
                    assert held.wait(3.0), "the UPDATE reached the main process"
                    query = dns.message.make_query(f"p1.{ZONE}", "A")
                    started = time.monotonic()
                    sock.sendto(query.to_wire(), ("127.0.0.1", port))
                    sock.settimeout(1.0)   # the old forwarder held the worker FORWARD_TIMEOUT (2 s)
                    reply = dns.message.from_wire(sock.recv(4096))
                    waited = time.monotonic() - started
                    assert reply.id == query.id
                finally:
                    gate.set()
                sock.settimeout(3.0)
                return waited, update, sock.recv(4096)   # then the UPDATE's answer, to the same port

        waited, update, answer = await asyncio.to_thread(client)
        print(f"a query to the worker whose UPDATE waited was answered in {waited * 1000:.1f} ms")
        assert answer[:2] == update[:2] and answer[2] & 0x80 and zone.workers.forwarded == 1
    finally:
        await _stop(zone, pids)


# --- a delta that does not apply: the worker asks for a snapshot -------------------------------------------

def _fed(frames: list[bytes]) -> list[tuple[Any, ...]]:
    return [pickle.loads(data[4:]) for data in frames]


async def test_a_worker_given_a_delta_on_a_generation_it_lacks_asks_for_a_snapshot_and_answers_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    feeder = DnsWorkers(DnsSettings(zone=ZONE, workers=2), lambda: None)
    first = tables_for([ha("shop")], {"shop": up("sfo1")})
    second = tables_for([ha("shop"), ha("blog")], {"shop": up("sfo1"), "blog": up("ams1")}, previous=first)
    worker = Worker(-1, -1)
    sent: list[object] = []
    monkeypatch.setattr(worker, "_send", sent.append)
    for message in _fed(await feeder._encode(None, 0, first, 1)):
        assert await worker._apply(message)
    assert worker.gen == 1 and sent == [("ack", 1)]

    for message in _fed(await feeder._encode(first, 7, second, 2)):  # based on a generation it never had
        assert await worker._apply(message)
    assert worker.gen == 1 and sent[1:] == [("resync", 2, 1)]   # asked once for the whole delta
    assert worker.holder.tables is not None and worker.holder.tables.serial == first.serial  # still answering
    assert _answers(worker.holder, f"shop.{ZONE}") and not _answers(worker.holder, f"blog.{ZONE}")

    for message in _fed(await feeder._encode(None, 0, second, 2)):  # the snapshot, same generation
        assert await worker._apply(message)
    assert worker.gen == 2 and sent[2:] == [("ack", 2)] and worker.resyncs == 1
    assert _answers(worker.holder, f"blog.{ZONE}")


def _sent(slot: Slot, tables: ZoneTables, gen: int) -> Slot:
    """``slot`` connected (its writer is never written to here) and sent generation ``gen``."""
    slot.writer = object()  # type: ignore[assignment]
    slot.sent, slot.sent_gen = tables, gen
    return slot


def _answers(holder: ZoneHolder, name: str) -> bool:
    responder = Responder(holder, DnsCounters())
    out = responder.respond(dns.message.make_query(name, "A").to_wire(), "192.0.2.200", tcp=False)
    return out is not None and bool(dns.message.from_wire(out).answer)


async def test_the_main_process_answers_a_resync_with_one_snapshot_counted() -> None:
    feeder = DnsWorkers(DnsSettings(zone=ZONE, workers=2), lambda: None)
    slot = _sent(feeder.slots[0], tables_for([ha("shop")], {"shop": up("sfo1")}), 5)
    reader = asyncio.StreamReader()
    reader.feed_data(frame(("resync", 5, 3)) + frame(("resync", 4, 3)) + frame(("resync", 5, 3)))
    reader.feed_eof()
    await feeder._listen(slot, reader)
    assert slot.sent is None and (slot.sent_gen, slot.resyncs) == (0, 1)  # the next round sends the whole tables
    assert feeder._wake.is_set()
    reader = asyncio.StreamReader()
    reader.feed_data(frame(("resync", 6, 3)))   # a later delta that does not apply either: again
    reader.feed_eof()
    await feeder._listen(slot, reader)
    assert slot.resyncs == 2


async def test_a_worker_whose_delta_does_not_apply_is_resynced(service: ZoneService) -> None:
    workers = service.workers
    assert workers is not None
    await wait_for(workers.in_step, timeout=5, interval=0.05, message="both workers on the first tables")
    workers.slots[0].sent_gen += 100   # the main process's record of worker 0 is wrong: its next delta can't apply
    service.store.put(project_key("fresh"), Project("fresh", ("ams1",)))
    await service.compiled()
    await wait_for(workers.in_step, timeout=10, interval=0.05, message="worker 0 resynced to the newest tables")
    assert [s.resyncs for s in workers.slots] == [1, 0]
    share, _ = await _answered_by_both(service, f"fresh.{ZONE}", {"192.0.2.2"})
    assert min(share) > 0, share
    text = generate_latest(REGISTRY[id(service)]).decode()
    assert 'region_agent_dns_worker_resyncs_total{worker="0"} 1.0' in text


# --- no tables yet: the workers answer SERVFAIL, as one process does ----------------------------------------

def _rcodes(port: int, name: str, count: int) -> list[int | None]:
    """``count`` A queries, each from a new source port (so both workers): their rcodes (None: no answer)."""
    wire = dns.message.make_query(name, dns.rdatatype.A).to_wire()
    out: list[int | None] = []
    for _ in range(count):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(2.0)
            sock.sendto(wire, ("127.0.0.1", port))
            try:
                out.append(dns.message.from_wire(sock.recv(4096)).rcode())
            except TimeoutError:
                out.append(None)
    return out


async def test_workers_answer_servfail_when_the_first_compile_fails_then_the_zone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("bad entry")

    monkeypatch.setattr(zone_service, "compile_zone", failing)   # the start's one-go compile fails
    zone = ZoneService(DnsSettings(zone=ZONE, listen_addresses=("127.0.0.1",), port=0, workers=2), _store(),
                       CollectorRegistry())
    assert zone.workers is not None
    zone.set_health_known()
    started = time.monotonic()
    try:
        await asyncio.wait_for(zone.start(), 15)   # it waited START_TIMEOUT (60 s) for a snapshot, then failed
        took = time.monotonic() - started
        assert zone.tables is None and zone.problems()[0].startswith("zone compile failed, answering SERVFAIL")
        rcodes = await asyncio.to_thread(_rcodes, _port(zone), f"p1.{ZONE}", 40)
        assert rcodes == [dns.rcode.SERVFAIL] * 40, rcodes
        assert all(count > 0 for count in await _reported_answers(zone.workers, 40)), "both workers answered"
        print(f"started without a zone in {took:.2f} s; 40 queries: SERVFAIL from both workers")

        zone.store.put(project_key("fresh"), Project("fresh", ("ams1",)))   # the next compile (sliced) works
        await zone.compiled()
        await wait_for(zone.workers.in_step, timeout=10, interval=0.05, message="the workers get the zone")
        rcodes = await asyncio.to_thread(_rcodes, _port(zone), f"p1.{ZONE}", 20)
        assert rcodes == [dns.rcode.NOERROR] * 20, rcodes
    finally:
        pids = [s.pid for s in zone.workers.slots]
        await _stop(zone, pids)


async def _reported_answers(workers: DnsWorkers, total: int) -> list[int]:
    await wait_for(lambda: sum(workers.answers_by_worker()) >= total, timeout=5, interval=0.05,
                   message="the workers report their counts")
    return workers.answers_by_worker()


# --- per-worker limits: the UPDATE forward budget is one process's divided by N ------------------------------

def test_the_workers_forward_budget_adds_up_to_one_process() -> None:
    one = (20.0, 40.0)   # acme.updates_per_second 20, burst twice that (service.acme_updates)
    for workers in (2, 4, 8):
        rate, burst = forward_budget(DnsSettings(zone=ZONE, workers=workers))
        assert (rate * workers, burst * workers) == pytest.approx(one)
    assert forward_budget(DnsSettings(zone=ZONE, workers=64)) == pytest.approx((20 / 64, 1.0))  # a burst of 1 at least


async def test_one_worker_forwards_its_share_of_the_update_budget() -> None:
    """acme.updates_per_second 2 (a burst of 4) over 2 workers: one client socket (one worker) gets 2 forwarded."""
    zone = ZoneService(DnsSettings(zone=ZONE, listen_addresses=("127.0.0.1",), port=0, workers=2,
                                   acme={"updates_per_second": 2}), _store(), CollectorRegistry())
    assert zone.workers is not None
    zone.workers._updates = lambda: lambda data, source, **_: _answer_header(data)
    zone.set_health_known()
    await zone.start()
    pids = [s.pid for s in zone.workers.slots]
    try:
        port = _port(zone)

        def burst() -> list[int]:
            rcodes = []
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.settimeout(3.0)
                for _ in range(8):
                    sock.sendto(_update_wire(), ("127.0.0.1", port))
                    rcodes.append(sock.recv(4096)[3] & 0x0F)
            return rcodes

        rcodes = await asyncio.to_thread(burst)
        assert rcodes.count(dns.rcode.NOERROR) in (2, 3), rcodes   # 2, and 1 more if a second went by
        assert rcodes.count(dns.rcode.REFUSED) == 8 - rcodes.count(dns.rcode.NOERROR)
    finally:
        await _stop(zone, pids)


def test_a_forward_with_an_earlier_deadline_than_those_before_it_is_dropped_on_time() -> None:
    """The table's timeout may change while forwards wait: the earliest deadline is the minimum, not the oldest."""
    table = ForwardTable(limit=4, timeout=5.0)
    first = table.begin(lambda out: None, 0.0)
    table.timeout = 0.05
    second = table.begin(lambda out: None, 0.0)
    assert table.next_deadline() == 0.05
    assert table.expire(0.1) == 1 and second not in table.pending and first in table.pending
    assert table.next_deadline() == 5.0
