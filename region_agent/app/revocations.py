"""Revoked identity certificates: a file of fingerprints every agent reads, applied without a restart.

``gossip.revoked_file`` lists SHA-256 fingerprints of certificates (as ``openssl x509 -fingerprint
-sha256`` prints them, colons optional, or the 32-digit prefix the agents log), one per line,
``#`` comments allowed. A revoked certificate signs nothing more: its entries, member records and
observations are refused, its TLS handshakes too, and what the store holds signed by it is dropped
(every agent with the same file drops the same entries, so digests converge). Distribute the same
file to every region, as the CA.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

from region_agent.base.files import FileWatcher
from region_agent.base.identity import FINGERPRINT_HEX, CertBook
from region_agent.state.store import Store

logger = logging.getLogger("region_agent.gossip")
_HEX = re.compile(r"[0-9a-f]{32}([0-9a-f]{32})?")
POLL_SECONDS = 5.0
MAX_BYTES = 1024 * 1024


class RevocationError(ValueError):
    pass


def parse_revoked(text: str, source: str) -> frozenset[str]:
    out = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip().replace(":", "").lower()
        if not line:
            continue
        if _HEX.fullmatch(line) is None:
            raise RevocationError(f"{source} line {number}: {raw.strip()[:80]!r} is not a SHA-256 fingerprint")
        out.add(line[:FINGERPRINT_HEX])
    return frozenset(out)


class Revocations:
    def __init__(self, path: Path, book: CertBook, store: Store, *,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.path = path
        self.book = book
        self.store = store
        self.on_change = on_change
        self.watch = FileWatcher(path, what="revoked certificates file", keeping="keeping the previous list",
                                 logger=logger, errors=RevocationError)

    def _read(self) -> frozenset[str]:
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise RevocationError(f"{self.path}: {exc.strerror or exc}") from None
        if len(data) > MAX_BYTES:
            raise RevocationError(f"{self.path}: larger than {MAX_BYTES} bytes")
        try:
            return parse_revoked(data.decode(), str(self.path))
        except UnicodeDecodeError:
            raise RevocationError(f"{self.path}: not UTF-8 text") from None

    def load(self) -> None:
        """At start: a bad file stops the agent (raises :class:`RevocationError`)."""
        self._apply(self.watch.read_now(self._read))

    def check(self, _forced: bool = False) -> None:
        revoked = self.watch.read_if_due(self._read)
        if revoked is not None and revoked != self.book.revoked:
            self._apply(revoked)

    def _apply(self, revoked: frozenset[str]) -> None:
        added = revoked - self.book.revoked
        self.book.set_revoked(revoked)
        dropped = self.store.drop(lambda e: e.signer in added) if added else []
        logger.info("revoked certificates: %d (%d new); %d store entries they signed dropped", len(revoked),
                    len(added), len(dropped))
        self.on_change()

    def problems(self) -> tuple[str, ...]:
        return self.watch.problems()

    async def run(self) -> None:
        await self.watch.run(self.check, POLL_SECONDS)
