"""The gossip keyring as a file, and a watcher that applies its changes to the live keyring.

Format (JSON)::

    {"primary": "<base64 key>", "keys": ["<base64 key>", ...]}

``primary`` encrypts; every key in ``keys`` (the primary among them) is accepted. Keys are standard
base64 of 16, 24 or 32 bytes, as ``region-agent keys generate`` (and ``serf keygen``) print them.

Rotation without losing a member, the same three steps as ``serf keys``, each applied to every
agent's file before the next (a Secret shared by all agents does that in one edit):

1. ``region-agent keys install NEW --file F``: every agent accepts NEW, still sends with OLD;
2. ``region-agent keys use NEW --file F``: every agent sends with NEW and still accepts OLD;
3. ``region-agent keys remove OLD --file F``: OLD is no longer accepted.

:class:`KeyringWatcher` re-reads the file when it changes and applies ``install``, ``use`` and
``remove`` to the running :class:`~region_agent.gossip.keyring.Keyring` in place, so the transport uses
the new keys without a restart. A file that can not be used keeps the current keys and is shown as
:attr:`KeyringWatcher.problem`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from region_agent.base.files import FileWatcher, atomic_write
from region_agent.gossip.keyring import KeyOperationError, Keyring, encode_key, parse_key

logger = logging.getLogger("region_agent.gossip")

FILE_MODE = 0o600
MAX_FILE_BYTES = 64 * 1024


class KeyringFileError(ValueError):
    """The keyring file can not be used; the message names the file and what is wrong."""


def fingerprint(key: bytes) -> str:
    """A short, safe name for a key in logs: never the key itself."""
    return hashlib.sha256(key).hexdigest()[:12]


def parse_keyring(text: str, path: str | os.PathLike[str] = "<keyring>") -> tuple[bytes, list[bytes]]:
    """The primary key and all keys (primary first, no duplicates) from the file's text."""
    try:
        data: Any = json.loads(text)
    except ValueError as exc:
        raise KeyringFileError(f"keyring file {path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise KeyringFileError(f'keyring file {path}: expected an object {{"primary": ..., "keys": [...]}}')
    unknown = sorted(set(data) - {"primary", "keys"})
    if unknown:
        raise KeyringFileError(f"keyring file {path}: unknown field {unknown[0]!r} (expected primary, keys)")
    keys_text = data.get("keys")
    if not isinstance(keys_text, list) or not all(isinstance(k, str) for k in keys_text):
        raise KeyringFileError(f'keyring file {path}: "keys" must be a list of base64 strings')
    if not keys_text:
        raise KeyringFileError(f'keyring file {path}: "keys" is empty; a keyring needs at least one key')
    primary_text = data.get("primary")
    if not isinstance(primary_text, str):
        raise KeyringFileError(f'keyring file {path}: "primary" must be a base64 string')
    keys: list[bytes] = []
    for i, text_key in enumerate(keys_text):
        try:
            key = parse_key(text_key)
        except KeyOperationError as exc:
            raise KeyringFileError(f"keyring file {path}: keys[{i}]: {exc}") from None
        if key not in keys:
            keys.append(key)
    try:
        primary = parse_key(primary_text)
    except KeyOperationError as exc:
        raise KeyringFileError(f"keyring file {path}: primary: {exc}") from None
    if primary not in keys:
        raise KeyringFileError(f'keyring file {path}: the primary key is not in "keys"')
    keys.remove(primary)
    return primary, [primary, *keys]


def read_keyring_file(path: str | os.PathLike[str]) -> tuple[bytes, list[bytes]]:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyringFileError(f"keyring file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise KeyringFileError(f"keyring file {path}: over {MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyringFileError(f"keyring file {path}: not UTF-8") from None
    return parse_keyring(text, path)


def load_keyring(path: str | os.PathLike[str]) -> Keyring:
    """A :class:`Keyring` from the file; raises :class:`KeyringFileError` naming the path."""
    primary, keys = read_keyring_file(path)
    return Keyring(primary, keys[1:])


def dump_keyring(keyring: Keyring) -> str:
    installed = keyring.keys()
    return json.dumps({"primary": encode_key(keyring.primary), "keys": [encode_key(k) for k in installed]},
                      indent=2) + "\n"


def save_keyring(path: str | os.PathLike[str], keyring: Keyring) -> None:
    """Write atomically (temporary file, fsync, rename, fsync of the directory), mode 0600."""
    atomic_write(path, dump_keyring(keyring).encode(), mode=FILE_MODE)


def apply_keys(keyring: Keyring, primary: bytes, keys: list[bytes]) -> list[str]:
    """Make ``keyring`` hold exactly ``keys`` with ``primary`` first: install, then use, then remove.

    Returns what changed, for the log (key fingerprints, never keys).
    """
    changes: list[str] = []
    for key in keys:
        installed = keyring.keys()
        if key not in installed:
            keyring.install(key)
            changes.append(f"installed {fingerprint(key)}")
    if keyring.primary != primary:
        keyring.use(primary)
        changes.append(f"using {fingerprint(primary)}")
    installed = keyring.keys()
    for key in installed:
        if key not in keys:
            keyring.remove(key)
            changes.append(f"removed {fingerprint(key)}")
    return changes


class KeyringWatcher:
    """Keep a live :class:`Keyring` equal to its file; ``run()`` until cancelled."""

    def __init__(self, path: str | os.PathLike[str], keyring: Keyring, poll: float = 2.0) -> None:
        self.path = Path(path)
        self.keyring = keyring
        self.poll = poll
        self.reloads = 0
        # Never read yet, so the first check reads (the file may have changed since the start).
        self.watch = FileWatcher(self.path, what="gossip keyring file", keeping="keeping the current keys",
                                 logger=logger, errors=KeyringFileError)

    @property
    def problem(self) -> str | None:
        """Why the file's current content is not in use (the previous keys are), or None."""
        return self.watch.problem

    def problems(self) -> tuple[str, ...]:
        return self.watch.problems()

    def check(self) -> bool:
        """Read the file if it changed (or the last read failed); True when the keyring changed."""
        read = self.watch.read_if_due(lambda: read_keyring_file(self.path))
        if read is None:
            return False
        primary, keys = read
        changes = apply_keys(self.keyring, primary, keys)
        if changes:
            self.reloads += 1
            logger.info("gossip keyring from %s: %s", self.path, ", ".join(changes))
        return bool(changes)

    async def run(self) -> None:
        await self.watch.run(lambda _forced: self.check(), self.poll)
