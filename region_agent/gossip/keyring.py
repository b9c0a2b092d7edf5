"""Encryption and authentication of gossip datagrams with a keyring (AES-GCM), as Serf's ``keys``.

The keyring holds one *primary* key, used to encrypt, and any number of other *installed* keys,
all tried when decrypting. Rotation without downtime, the same three steps as ``serf keys``:
``install`` the new key everywhere, ``use`` it everywhere (each agent now sends with it, and every
agent can still read the old one), then ``remove`` the old key everywhere.

Datagram layout: ``version (1 byte) | nonce (12 bytes) | ciphertext | tag (16 bytes)``; the version
byte is authenticated as associated data. Nonces are random: with 96-bit random nonces the chance of
a repeat after q messages under one key is about q²/2⁹⁷ — 4·10⁻⁹ after a month of 10,000 datagrams
per second cluster-wide — so rotate keys at least monthly.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = 1 + NONCE_BYTES + TAG_BYTES
KEY_SIZES = (16, 24, 32)  # AES-128, AES-192, AES-256


class KeyringError(Exception):
    """A datagram this keyring can not open; ``reason`` is the metric label."""

    reason = "malformed"


class WrongKeyError(KeyringError):
    """No installed key authenticates the datagram: another cluster, an old key, or tampering."""

    reason = "key"


class UnsupportedVersionError(KeyringError):
    reason = "version"


class KeyOperationError(ValueError):
    """A key operation that is not allowed (bad key, removing the primary, using an unknown key)."""


def generate_key() -> bytes:
    return os.urandom(32)


def encode_key(key: bytes) -> str:
    return base64.b64encode(key).decode()


def parse_key(text: str) -> bytes:
    """A key as ``serf keygen`` prints it: standard base64 of 16, 24 or 32 bytes."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise KeyOperationError("a key is base64 of 16, 24 or 32 bytes") from None
    _check_key(key)
    return key


def _check_key(key: object) -> None:
    if not isinstance(key, bytes) or len(key) not in KEY_SIZES:
        raise KeyOperationError("a key is 16, 24 or 32 bytes (AES-128, AES-192, AES-256)")


class Keyring:
    def __init__(self, primary: bytes, others: Iterable[bytes] = ()) -> None:
        _check_key(primary)
        self._keys: list[bytes] = [primary]
        self._ciphers: dict[bytes, AESGCM] = {primary: AESGCM(primary)}
        for key in others:
            self.install(key)

    @property
    def primary(self) -> bytes:
        return self._keys[0]

    def keys(self) -> list[bytes]:
        """Installed keys, the primary first."""
        return list(self._keys)

    def install(self, key: bytes) -> None:
        """Accept datagrams under ``key`` too (idempotent)."""
        _check_key(key)
        if key not in self._ciphers:
            self._keys.append(key)
            self._ciphers[key] = AESGCM(key)

    def use(self, key: bytes) -> None:
        """Encrypt with ``key`` from now on; it must be installed first."""
        if key not in self._ciphers:
            raise KeyOperationError("install a key before using it")
        self._keys.remove(key)
        self._keys.insert(0, key)

    def remove(self, key: bytes) -> None:
        """Stop accepting ``key``; the primary can not be removed (use another key first)."""
        if key == self.primary:
            raise KeyOperationError("the primary key can not be removed; use another key first")
        if key not in self._ciphers:
            raise KeyOperationError("key not installed")
        self._keys.remove(key)
        del self._ciphers[key]

    def encrypt(self, plaintext: bytes) -> bytes:
        header = bytes([VERSION])
        nonce = os.urandom(NONCE_BYTES)
        return header + nonce + self._ciphers[self.primary].encrypt(nonce, plaintext, header)

    def decrypt(self, data: bytes) -> bytes:
        """The plaintext, trying the primary first; raises a :class:`KeyringError` and nothing else."""
        if len(data) < OVERHEAD:
            raise KeyringError("datagram shorter than the encryption header")
        if data[0] != VERSION:
            raise UnsupportedVersionError(f"encryption version {data[0]}")
        header, nonce, sealed = data[:1], data[1:1 + NONCE_BYTES], data[1 + NONCE_BYTES:]
        for key in self._keys:
            try:
                return self._ciphers[key].decrypt(nonce, sealed, header)
            except InvalidTag:
                continue
        raise WrongKeyError("no installed key opens the datagram")
