"""The TSIG keys file (``dns.acme.tsig_keys_file``, a mounted Secret), re-read when it changes.

Format (YAML or JSON), the same as cert-manager's RFC 2136 issuer is given::

    acme-key: {algorithm: hmac-sha256, secret: <base64>}
    old-key: {algorithm: hmac-md5, secret: <base64>}

Rotation without a restart: add the new key to the file (both keys verify), switch cert-manager
to it, remove the old one. :class:`TsigKeysWatcher` polls the file's mtime, size and inode (a
Kubernetes Secret volume swaps a symlink, which changes all three) every ``poll`` seconds and
puts a new :class:`~region_agent.globaldns.acme.tsig.TsigKeyring` — the settings' inline keys plus the file's — into
the running :class:`~region_agent.globaldns.acme.service.AcmeUpdates` in one assignment, so an UPDATE is verified
against either the old keys or the new ones, never a mix. A file that can not be used keeps the
current keys, counts ``region_agent_dns_tsig_keys_file_errors_total`` and is shown as
:attr:`TsigKeysWatcher.problem` (the agent is degraded until the file is fixed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import dns.name
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge

from region_agent.base.files import FileWatcher
from region_agent.globaldns.acme.service import AcmeUpdates
from region_agent.globaldns.acme.tsig import KeySpec, TsigConfigError, TsigKeyring
from region_agent.globaldns.settings import AcmeSettings

logger = logging.getLogger("region_agent.dns.acme")

MAX_FILE_BYTES = 64 * 1024
POLL_SECONDS = 2.0


def read_keys_file(path: str | os.PathLike[str]) -> list[KeySpec]:
    """The keys in the file; raises :class:`TsigConfigError` naming the file (and the key) when unusable."""
    where = f"dns.acme.tsig_keys_file {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise TsigConfigError(f"{where}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise TsigConfigError(f"{where}: over {MAX_FILE_BYTES} bytes")
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise TsigConfigError(f"{where}: {exc}") from None
    if data is None:
        return []  # an empty file: no keys (yet)
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise TsigConfigError(f"{where}: must map key names to {{algorithm, secret}}")
    try:
        return TsigKeyring.from_mapping(data).specs  # validates every key (algorithm, base64, length, duplicates)
    except TsigConfigError as exc:
        raise TsigConfigError(f"{where}: {exc}") from None


def inline_keys(settings: AcmeSettings) -> list[KeySpec]:
    """The keys written in the settings themselves (``dns.acme.tsig_keys``)."""
    return [KeySpec(k.name, k.algorithm, k.secret) for k in settings.tsig_keys]


def build_keyring(static: Sequence[KeySpec], path: str | os.PathLike[str] | None) -> TsigKeyring:
    """The settings' inline keys plus the file's; raises :class:`TsigConfigError` (a duplicate name too)."""
    specs = list(static) + (read_keys_file(path) if path is not None else [])
    return TsigKeyring(specs)


class TsigKeysMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter("region_agent_dns_tsig_keys_file_errors",
                              "Reads of the TSIG keys file that could not be used (the previous keys stay)",
                              registry=registry)
        self.reloads = Counter("region_agent_dns_tsig_keys_file_reloads",
                               "Changes of the TSIG keys file taken into use", registry=registry)
        self.keys = Gauge("region_agent_dns_tsig_keys", "TSIG keys UPDATEs may be signed with", registry=registry)
        self.last_success = Gauge("region_agent_dns_tsig_keys_file_last_success_timestamp_seconds",
                                  "Unix time of the last good read of the TSIG keys file", registry=registry)


class TsigKeysWatcher:
    """Keep the live UPDATE keyring equal to the settings' keys plus the file's; ``run()`` until cancelled."""

    def __init__(self, path: str | os.PathLike[str], static: Sequence[KeySpec], acme: AcmeUpdates,
                 registry: CollectorRegistry, *, poll: float = POLL_SECONDS) -> None:
        self.path = Path(path)
        self.static = list(static)
        self.acme = acme
        self.poll = poll
        self.metrics = TsigKeysMetrics(registry)
        self.metrics.keys.set_function(lambda: len(self.acme.config.keyring))
        # Never read yet, so the first check reads (the file may have changed since the start read
        # it); an unchanged file changes nothing and logs nothing.
        self.watch = FileWatcher(self.path, what="TSIG keys file", keeping="keeping the current keys",
                                 logger=logger, errors=TsigConfigError)
        self._names = _names(acme.config.keyring)
        self.metrics.last_success.set(time.time())

    @property
    def problem(self) -> str | None:
        """Why the file's current content is not in use (the previous keys are), or None."""
        return self.watch.problem

    def problems(self) -> tuple[str, ...]:
        return self.watch.problems()

    def _build(self) -> TsigKeyring:
        try:
            return build_keyring(self.static, self.path)
        except TsigConfigError:
            self.metrics.errors.inc()
            raise

    def check(self) -> bool:
        """Read the file if it changed (or the last read failed); True when the keys in use changed."""
        keyring = self.watch.read_if_due(self._build)
        if keyring is None:
            return False
        self.metrics.last_success.set(time.time())
        old = self.acme.config.keyring
        if _same(old, keyring):
            return False
        self.acme.config = dataclasses.replace(self.acme.config, keyring=keyring)  # one assignment: old or new
        names = _names(keyring)
        added, removed = sorted(names - self._names), sorted(self._names - names)
        changed = sorted(n for n in names & self._names
                         if _material(old, dns.name.from_text(n)) != _material(keyring, dns.name.from_text(n)))
        self._names = names
        self.metrics.reloads.inc()
        logger.info("TSIG keys from %s: %d key(s); added %s, removed %s, changed %s", self.path, len(keyring),
                    ", ".join(added) or "none", ", ".join(removed) or "none", ", ".join(changed) or "none")
        return True

    async def run(self) -> None:
        await self.watch.run(lambda _forced: self.check(), self.poll)


def _names(keyring: TsigKeyring) -> set[str]:
    return {name.to_text() for name in keyring.keys}


def _material(keyring: TsigKeyring, name: dns.name.Name) -> tuple[object, object]:
    key = keyring.keys[name]
    return (key.secret, key.algorithm)


def _same(a: TsigKeyring, b: TsigKeyring) -> bool:
    return a.keys.keys() == b.keys.keys() and all(_material(a, n) == _material(b, n) for n in a.keys)
