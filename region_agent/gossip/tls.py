"""Mutual TLS for gossip streams under a cluster CA.

Both ends of a stream present a certificate signed by the cluster CA and verify the other's: the
listener with ``CERT_REQUIRED``, the connecting side against the same CA. Peers are addressed by
IP, so the host name is not checked; the chain to the CA is (and the certificate's validity dates
and, when present, its extended key usage). TLS 1.3 only.

Inside TLS the stream message stays sealed by the gossip keyring, as before (defence in depth): a
peer needs both a certificate and the current gossip key, a leaked certificate alone or a leaked
key alone admits no one, and the frame (which carries the sender's advertised address) is the same
with and without TLS. The cost is one AES-GCM pass per stream message, small beside the handshake.

:meth:`GossipTls.from_files` reads and checks the three PEM files at start and fails with an error
naming the file. Kubernetes rotates a mounted Secret by swapping a symlink: :meth:`GossipTls.run`
polls the files and :meth:`GossipTls.reload` builds new contexts, used by the next connection; a
bad new set keeps the current contexts and is shown as :attr:`GossipTls.problem`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from region_agent.base.files import FileWatcher
from region_agent.base.identity import IdentityError, Signer, identity_of, issued_by

logger = logging.getLogger("region_agent.gossip")

HANDSHAKE_TIMEOUT = 5.0

class TlsConfigError(ValueError):
    """The CA, certificate or key file can not be used; the message names the file."""


@dataclass(frozen=True)
class _Contexts:
    server: ssl.SSLContext
    client: ssl.SSLContext
    subject: str
    not_after: datetime
    authorities: tuple[x509.Certificate, ...] = ()
    signer: Signer | None = None     # None: the certificate names no agent identity (a lab certificate)
    identity_problem: str = ""       # why it names none


def _read(role: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"gossip TLS {role} file {path}: {exc.strerror or exc}") from None


def _certificates(role: str, path: Path, data: bytes) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TlsConfigError(f"gossip TLS {role} file {path}: not a PEM certificate") from None
    if not certs:
        raise TlsConfigError(f"gossip TLS {role} file {path}: no certificate in it")
    return certs


def _public(key: object) -> bytes:
    return key.public_bytes(  # type: ignore[attr-defined, no-any-return]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _load(ca: Path, cert: Path, key: Path, now: datetime | None = None) -> _Contexts:
    now = now or datetime.now(UTC)
    authorities = _certificates("CA", ca, _read("CA", ca))
    for authority in authorities:
        try:
            is_ca = authority.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise TlsConfigError(f"gossip TLS CA file {ca}: {authority.subject.rfc4514_string()} is not a CA "
                                 "certificate (basicConstraints CA:TRUE)")
    chain = _certificates("certificate", cert, _read("certificate", cert))
    leaf = chain[0]
    try:
        private = serialization.load_pem_private_key(_read("key", key), password=None)
    except (ValueError, TypeError):
        raise TlsConfigError(f"gossip TLS key file {key}: not an unencrypted PEM private key") from None
    if _public(private.public_key()) != _public(leaf.public_key()):
        raise TlsConfigError(f"gossip TLS key file {key} does not match the certificate in {cert}")
    if not any(issued_by(leaf, authority) for authority in [*authorities, *chain[1:]]):
        raise TlsConfigError(f"gossip TLS certificate file {cert}: not signed by the CA in {ca}")
    if now < leaf.not_valid_before_utc:
        raise TlsConfigError(f"gossip TLS certificate file {cert}: not valid before {leaf.not_valid_before_utc}")
    if now > leaf.not_valid_after_utc:
        raise TlsConfigError(f"gossip TLS certificate file {cert}: expired on {leaf.not_valid_after_utc}")
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.load_verify_locations(cadata=b"".join(
                a.public_bytes(serialization.Encoding.PEM) for a in authorities).decode())
            context.load_cert_chain(str(cert), str(key))
        server.verify_mode = ssl.CERT_REQUIRED
        client.check_hostname = False  # peers are addressed by IP; the chain to the CA is what counts
        client.verify_mode = ssl.CERT_REQUIRED
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"gossip TLS certificate {cert} / key {key}: {exc}") from None
    signer, problem = None, ""
    try:
        identity = identity_of(leaf, authorities, now.timestamp())
        if not isinstance(private, ec.EllipticCurvePrivateKey):
            raise IdentityError("the key must be EC P-256")
        signer = Signer(private, identity)
    except IdentityError as exc:
        problem = str(exc)
    return _Contexts(server, client, leaf.subject.rfc4514_string(), leaf.not_valid_after_utc, tuple(authorities),
                     signer, problem)


class TlsServerStream:
    """The listening end of one TLS connection, driven over a plain asyncio stream with memory BIOs.

    ``asyncio.StreamWriter.start_tls`` on an accepted connection loses a ClientHello that arrived
    before the switch under uvloop, and ``start_server(ssl=...)`` swallows handshake failures (so
    they could not be counted); doing the TLS here keeps every byte and every error in our hands,
    on both event loops.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: ssl.SSLContext) -> None:
        self._reader = reader
        self._writer = writer
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=True)

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            self._writer.write(data)
            await self._writer.drain()

    async def _fill(self) -> None:
        data = await self._reader.read(64 * 1024)
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    async def handshake(self) -> None:
        """Complete the handshake; raises ``ssl.SSLError`` (sending the alert first) or ``OSError``."""
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
            except ssl.SSLError:
                with contextlib.suppress(OSError):
                    await self._flush()  # the alert tells the peer why
                raise
        await self._flush()

    def peer_certificate(self) -> bytes | None:
        """The peer's certificate (DER) once the handshake is done."""
        return self._ssl.getpeercert(binary_form=True)

    async def readexactly(self, n: int) -> bytes:
        buffer = bytearray()
        while len(buffer) < n:
            try:
                chunk = self._ssl.read(n - len(buffer))
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
                continue
            except ssl.SSLZeroReturnError:
                chunk = b""
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(buffer), n)
            buffer += chunk
        return bytes(buffer)


class GossipTls:
    """Server and client SSL contexts from a CA, a certificate and its key, reloadable."""

    def __init__(self, ca: str | os.PathLike[str], cert: str | os.PathLike[str], key: str | os.PathLike[str], *,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        self.paths = (Path(ca), Path(cert), Path(key))
        self.handshake_timeout = handshake_timeout
        self.watch = FileWatcher(*self.paths, what="gossip TLS files", keeping="keeping the current certificates",
                                 logger=logger, errors=TlsConfigError)
        self._contexts = self.watch.read_now(self._read)
        self.listeners: list[Callable[[], None]] = []   # told after new files are in use
        # After a handshake: None when the peer's certificate is also an identity this agent trusts,
        # else why not (a rejected-messages reason). None: every certificate under the CA is taken.
        self.peer_check: Callable[[bytes], str | None] | None = None

    @classmethod
    def from_files(cls, ca: str | os.PathLike[str], cert: str | os.PathLike[str], key: str | os.PathLike[str], *,
                   handshake_timeout: float = HANDSHAKE_TIMEOUT) -> GossipTls:
        """Load and check the files now; raises :class:`TlsConfigError` naming the file that is wrong."""
        return cls(ca, cert, key, handshake_timeout=handshake_timeout)

    @property
    def problem(self) -> str | None:
        """Why the files' current content is not in use (the previous contexts are), or None."""
        return self.watch.problem

    def problems(self) -> tuple[str, ...]:
        return self.watch.problems()

    @property
    def server_context(self) -> ssl.SSLContext:
        return self._contexts.server

    @property
    def client_context(self) -> ssl.SSLContext:
        return self._contexts.client

    @property
    def subject(self) -> str:
        return self._contexts.subject

    @property
    def not_after(self) -> datetime:
        """When this agent's certificate expires (for a metric or a warning)."""
        return self._contexts.not_after

    @property
    def authorities(self) -> tuple[x509.Certificate, ...]:
        """The cluster CA bundle as last read."""
        return self._contexts.authorities

    @property
    def signer(self) -> Signer | None:
        """This agent's identity key and certificate (None: the certificate names no identity)."""
        return self._contexts.signer

    @property
    def identity_problem(self) -> str:
        return self._contexts.identity_problem

    def _read(self) -> _Contexts:
        return _load(*self.paths)

    def reload(self) -> None:
        """Re-read the files now; on error raise :class:`TlsConfigError` and keep the current contexts."""
        self._contexts = self.watch.read_now(self._read)

    def reload_if_changed(self) -> bool:
        """Reload when a file changed (or the last attempt failed); True when new contexts are in use."""
        contexts = self.watch.read_if_due(self._read)
        if contexts is None:
            return False
        self._contexts = contexts
        logger.info("gossip TLS certificate reloaded: %s, valid until %s", self.subject, self.not_after)
        for listener in self.listeners:
            listener()
        return True

    async def run(self, poll: float = 30.0) -> None:
        """Watch the files until cancelled (the kubelet refreshes a Secret volume about once a minute)."""
        await self.watch.run(lambda _forced: self.reload_if_changed(), poll)
