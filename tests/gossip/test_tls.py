"""Mutual TLS of gossip streams over real TCP on 127.0.0.x, with certificates made by ``region-agent keys``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import ssl
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from region_agent.cli.keys import CA_CERT_FILE, init_dir, issue_to_dir
from region_agent.gossip.keyring import Keyring
from region_agent.gossip.messages import Address
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.tls import GossipTls, TlsConfigError
from region_agent.gossip.transport import GossipTransport, SendLimits
from tests.conftest import wait_for

KEY = b"k" * 32
# Many streams at once to one peer: room for all of them in its send queue, so none is dropped (the
# queue's bound itself is tested in test_transport_sends.py).
BURST = SendLimits(queued_per_peer=100)


class Recorder:
    def __init__(self) -> None:
        self.packets: list[tuple[bytes, Address]] = []
        self.streams: list[tuple[bytes, Address]] = []

    def receive_packet(self, data: bytes, source: Address) -> None:
        self.packets.append((data, source))

    def receive_stream(self, data: bytes, source: Address) -> None:
        self.streams.append((data, source))


class Pki:
    """A cluster CA in a directory and agent certificates issued with the ``keys`` code."""

    def __init__(self, root: Path) -> None:
        self.root = root
        init_dir(root / "ca")

    def files(self, name: str, ip: str, **kwargs: Any) -> tuple[Path, Path, Path]:
        out = self.root / name
        issue_to_dir(self.root / "ca", name, out, ips=[ip], dns=[], **kwargs)
        return out / CA_CERT_FILE, out / f"{name}.pem", out / f"{name}-key.pem"

    def tls(self, name: str, ip: str, **kwargs: Any) -> GossipTls:
        return GossipTls.from_files(*self.files(name, ip), **kwargs)


Start = Callable[..., Coroutine[Any, Any, tuple[GossipTransport, Recorder]]]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def other_pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "other")


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    started: list[GossipTransport] = []

    async def start_one(host: str, tls: GossipTls | None,
                        send_limits: SendLimits | None = None) -> tuple[GossipTransport, Recorder]:
        transport = await GossipTransport.start(host, 0, Keyring(KEY), GossipStats(), tls=tls,
                                                send_limits=send_limits)
        recorder = Recorder()
        transport.attach(recorder)
        started.append(transport)
        return transport, recorder

    yield start_one
    for transport in started:
        await transport.close()


def frame(sender: GossipTransport, payload: bytes) -> bytes:
    """A stream frame as ``StreamTransport.send_stream`` builds it (to send over a hand-made connection)."""
    host = sender.addr.host.encode()
    sealed = sender.keyring.encrypt(bytes([len(host)]) + host + struct.pack(">H", sender.addr.port) + payload)
    return struct.pack(">I", len(sealed)) + sealed


async def send_raw(addr: Address, data: bytes, context: ssl.SSLContext | None) -> None:
    """Connect (with TLS when ``context``), write, close; errors of a rejected connection are expected."""
    writer = None
    try:
        _, writer = await asyncio.open_connection(addr.host, addr.port, ssl=context,
                                                  server_hostname="" if context else None)
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(0)
    except (OSError, ConnectionError):
        pass
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.load_verify_locations(cafile=str(ca))
    if cert is not None and key is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


async def test_stream_delivered_under_mutual_tls(start: Start, pki: Pki) -> None:
    a, _ = await start("127.0.0.2", pki.tls("a", "127.0.0.2"))
    b, got_b = await start("127.0.0.3", pki.tls("b", "127.0.0.3"))
    a.send_stream(b.addr, b"push-pull " * 1000)
    await wait_for(lambda: got_b.streams, timeout=5, message="b gets a's stream")
    assert got_b.streams == [(b"push-pull " * 1000, a.addr)]
    a.send_packet(b.addr, b"ping")  # datagrams are untouched by TLS
    await wait_for(lambda: got_b.packets, timeout=5, message="b gets a's datagram")
    assert a.stats.rejected["tls"] == b.stats.rejected["tls"] == 0


async def test_stream_delivered_many_times(start: Start, pki: Pki) -> None:
    a, got_a = await start("127.0.0.2", pki.tls("a", "127.0.0.2"), BURST)
    b, got_b = await start("127.0.0.3", pki.tls("b", "127.0.0.3"), BURST)
    for i in range(30):
        a.send_stream(b.addr, b"a%d" % i)
        b.send_stream(a.addr, b"b%d" % i)
    await wait_for(lambda: len(got_a.streams) == len(got_b.streams) == 30, timeout=10, message="all 60 streams")
    assert sorted(d for d, _ in got_b.streams) == sorted(b"a%d" % i for i in range(30))
    assert a.stats.rejected["tls"] == b.stats.rejected["tls"] == 0
    assert not a.streams.counters.send_dropped and not b.streams.counters.send_dropped


async def test_certificate_of_another_ca_rejected_both_ways(start: Start, pki: Pki, other_pki: Pki) -> None:
    a, got_a = await start("127.0.0.2", pki.tls("a", "127.0.0.2"))
    c, got_c = await start("127.0.0.4", other_pki.tls("c", "127.0.0.4"))
    c.send_stream(a.addr, b"from another cluster")
    await wait_for(lambda: a.stats.rejected["tls"] >= 1, timeout=5, message="a rejects c's certificate")
    await wait_for(lambda: c.stats.rejected["tls"] >= 1, timeout=5, message="c rejects a's certificate")
    a.send_stream(c.addr, b"to another cluster")
    await wait_for(lambda: a.stats.rejected["tls"] >= 2, timeout=5, message="a rejects c's server certificate")
    assert got_a.streams == [] and got_c.streams == []


async def test_client_without_certificate_rejected(start: Start, pki: Pki) -> None:
    a, got_a = await start("127.0.0.2", pki.tls("a", "127.0.0.2"))
    b, _ = await start("127.0.0.3", None)
    await send_raw(a.addr, frame(b, b"no certificate"), client_context(pki.root / "ca" / CA_CERT_FILE))
    await wait_for(lambda: a.stats.rejected["tls"] == 1, timeout=5, message="a rejects a client without a cert")
    assert got_a.streams == []


async def test_plain_stream_to_tls_port_rejected(start: Start, pki: Pki) -> None:
    a, got_a = await start("127.0.0.2", pki.tls("a", "127.0.0.2"))
    plain, got_plain = await start("127.0.0.3", None)
    plain.send_stream(a.addr, b"plain text stream")
    await wait_for(lambda: a.stats.rejected["tls"] == 1, timeout=5, message="a rejects a plain TCP stream")
    assert got_a.streams == []
    a.send_stream(plain.addr, b"TLS to a plain port")  # the plain listener reads garbage: malformed
    await wait_for(lambda: plain.stats.rejected["malformed"] + plain.stats.rejected["too_large"] >= 1,
                   timeout=15, message="the plain port drops a TLS hello")
    assert got_plain.streams == []


async def test_expired_certificate_rejected(start: Start, pki: Pki) -> None:
    a, got_a = await start("127.0.0.2", pki.tls("a", "127.0.0.2"))
    b, _ = await start("127.0.0.3", None)
    ca, cert, key = pki.files("old", "127.0.0.3", not_before=datetime.now(UTC) - timedelta(days=30), days=1)
    with pytest.raises(TlsConfigError, match="expired"):
        GossipTls.from_files(ca, cert, key)  # refused at start ...
    await send_raw(a.addr, frame(b, b"expired"), client_context(ca, cert, key))  # ... and by a peer
    await wait_for(lambda: a.stats.rejected["tls"] == 1, timeout=5, message="a rejects an expired certificate")
    assert got_a.streams == []


async def test_handshake_timeout_bounded(start: Start, pki: Pki) -> None:
    a, _ = await start("127.0.0.2", pki.tls("a", "127.0.0.2", handshake_timeout=0.3))
    _, writer = await asyncio.open_connection(a.addr.host, a.addr.port)  # connects, says nothing
    try:
        # counted apart: under loss a handshake times out, and "tls" reads as a certificate refused
        await wait_for(lambda: a.stats.rejected["tls_timeout"] == 1, timeout=5, message="the silent client is dropped")
        assert a.stats.rejected["tls"] == 0
        assert await asyncio.wait_for(writer.transport.get_protocol()._stream_reader.read(), 5) == b""  # type: ignore[attr-defined]
    finally:
        writer.close()


async def test_failures_logged_once_per_peer(start: Start, pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    a, _ = await start("127.0.0.2", pki.tls("a", "127.0.0.2"))
    plain, _ = await start("127.0.0.3", None)
    with caplog.at_level(logging.WARNING, logger="region_agent.gossip"):
        for i in range(3):
            plain.send_stream(a.addr, b"plain")
            await wait_for(lambda i=i: a.stats.rejected["tls"] == i + 1, timeout=5, message="counted")  # type: ignore[misc]
    # the peer is the connection's source address (127.0.0.1 here: outgoing streams are not bound)
    warnings = [r for r in caplog.records if "TLS handshake with" in r.getMessage()]
    assert len(warnings) == 1


RUNNERS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run}
with contextlib.suppress(ImportError):  # uvloop is optional off Linux/macOS
    import uvloop

    RUNNERS["uvloop"] = uvloop.run


@pytest.mark.parametrize("loop", list(RUNNERS))
def test_on_both_event_loops(loop: str, pki: Pki, other_pki: Pki) -> None:
    """The agent runs on uvloop: delivery and every rejection there too, with many streams at once."""
    async def scenario() -> None:
        keyring = Keyring(KEY)
        a = await GossipTransport.start("127.0.0.2", 0, keyring, GossipStats(), tls=pki.tls("a", "127.0.0.2"),
                                        send_limits=BURST)
        b = await GossipTransport.start("127.0.0.3", 0, keyring, GossipStats(), tls=pki.tls("b", "127.0.0.3"),
                                        send_limits=BURST)
        c = await GossipTransport.start("127.0.0.4", 0, keyring, GossipStats(), tls=other_pki.tls("c", "127.0.0.4"))
        plain = await GossipTransport.start("127.0.0.5", 0, keyring, GossipStats())
        got_a, got_b = Recorder(), Recorder()
        a.attach(got_a)
        b.attach(got_b)
        try:
            for i in range(100):
                a.send_stream(b.addr, b"a%d" % i)
                b.send_stream(a.addr, b"b%d" % i)
            await wait_for(lambda: len(got_a.streams) == len(got_b.streams) == 100, timeout=20,
                           message="200 streams under mutual TLS")
            c.send_stream(a.addr, b"another CA")
            plain.send_stream(a.addr, b"plain")
            await send_raw(a.addr, frame(plain, b"no cert"), client_context(pki.root / "ca" / CA_CERT_FILE))
            await wait_for(lambda: a.stats.rejected["tls"] == 3, timeout=10, message="three rejections")
            assert len(got_a.streams) == 100 and b.stats.rejected["tls"] == 0
            assert not a.streams.counters.send_dropped and not b.streams.counters.send_dropped
        finally:
            for transport in (a, b, c, plain):
                await transport.close()

    RUNNERS[loop](scenario())


def test_from_files_errors_name_the_file(pki: Pki, other_pki: Pki, tmp_path: Path) -> None:
    ca, cert, key = pki.files("a", "127.0.0.2")
    _, other_cert, other_key = other_pki.files("c", "127.0.0.4")
    missing = tmp_path / "missing.pem"
    with pytest.raises(TlsConfigError, match=f"CA file {missing}"):
        GossipTls.from_files(missing, cert, key)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TlsConfigError, match=f"certificate file {garbage}: not a PEM"):
        GossipTls.from_files(ca, garbage, key)
    with pytest.raises(TlsConfigError, match=f"key file {garbage}: not an unencrypted PEM"):
        GossipTls.from_files(ca, cert, garbage)
    with pytest.raises(TlsConfigError, match=f"CA file {cert}: .* is not a CA"):
        GossipTls.from_files(cert, cert, key)
    with pytest.raises(TlsConfigError, match=f"key file {other_key} does not match"):
        GossipTls.from_files(ca, cert, other_key)
    with pytest.raises(TlsConfigError, match=f"certificate file {other_cert}: not signed by the CA in {ca}"):
        GossipTls.from_files(ca, other_cert, other_key)
    tls = GossipTls.from_files(ca, cert, key)
    assert tls.subject == "CN=a" and tls.problem is None


def test_reload_when_files_change_keeps_good_contexts(pki: Pki, other_pki: Pki) -> None:
    ca, cert, key = pki.files("a", "127.0.0.2")
    tls = GossipTls.from_files(ca, cert, key)
    assert not tls.reload_if_changed()
    first = tls.server_context
    _, other_cert, other_key = other_pki.files("c", "127.0.0.4")
    shutil.copyfile(other_cert, cert)  # a half-rotated Secret: a certificate of another CA
    shutil.copyfile(other_key, key)
    os.utime(cert, ns=(0, 1))
    assert not tls.reload_if_changed()
    problem = tls.problem
    assert problem is not None and "not signed by the CA" in problem
    assert tls.server_context is first  # still the good one
    _, new_cert, new_key = pki.files("a2", "127.0.0.2")
    shutil.copyfile(new_cert, cert)
    shutil.copyfile(new_key, key)
    assert tls.reload_if_changed()
    assert tls.problem is None and tls.subject == "CN=a2" and tls.server_context is not first


def test_refused_files_are_a_problem_until_good_ones_come(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="region_agent.gossip")
    ca, cert, key = pki.files("a", "127.0.0.2")
    tls = GossipTls.from_files(ca, cert, key)
    assert tls.problems() == ()
    good = key.read_bytes()
    key.write_text("not a key\n")
    assert not tls.reload_if_changed()
    assert tls.problems() == (f"gossip TLS files refused, keeping the current certificates: gossip TLS key file "
                              f"{key}: not an unencrypted PEM private key",)
    key.write_bytes(good)
    assert tls.reload_if_changed() and tls.problems() == ()
    assert any("gossip TLS files" in r.getMessage() and "usable again" in r.getMessage() for r in caplog.records)
