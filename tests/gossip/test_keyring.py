"""Keyring: AES-GCM datagrams, rotation (install, use, remove) and distinct rejection reasons."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from region_agent.gossip.keyring import (
    OVERHEAD,
    KeyOperationError,
    Keyring,
    KeyringError,
    UnsupportedVersionError,
    WrongKeyError,
    encode_key,
    generate_key,
    parse_key,
)

K1, K2, K3 = b"1" * 32, b"2" * 16, b"3" * 24


def test_round_trip_and_overhead() -> None:
    ring = Keyring(K1)
    sealed = ring.encrypt(b"ping")
    assert len(sealed) == len(b"ping") + OVERHEAD
    assert ring.decrypt(sealed) == b"ping"
    assert ring.encrypt(b"ping") != sealed  # fresh nonce every time


def test_wrong_key_is_a_key_rejection() -> None:
    with pytest.raises(WrongKeyError) as caught:
        Keyring(K2).decrypt(Keyring(K1).encrypt(b"x"))
    assert caught.value.reason == "key"


@pytest.mark.parametrize(("mangle", "error", "reason"), [
    (lambda b: b[:10], KeyringError, "malformed"),
    (lambda b: b"\x02" + b[1:], UnsupportedVersionError, "version"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), WrongKeyError, "key"),   # tag flipped
    (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], WrongKeyError, "key"),  # ciphertext flipped
])
def test_damaged_datagrams(mangle: Callable[[bytes], bytes], error: type[KeyringError], reason: str) -> None:
    ring = Keyring(K1)
    with pytest.raises(error) as caught:
        ring.decrypt(mangle(ring.encrypt(b"hello world")))
    assert caught.value.reason == reason


def test_rotation_without_downtime() -> None:
    a, b = Keyring(K1), Keyring(K1)
    # 1. install the new key everywhere: nothing changes on the wire yet
    a.install(K2)
    b.install(K2)
    assert a.primary == K1
    # 2. use it on one agent first: both still read each other
    a.use(K2)
    assert b.decrypt(a.encrypt(b"from a")) == b"from a"
    assert a.decrypt(b.encrypt(b"from b")) == b"from b"
    # 3. remove the old key where it is no longer primary: old-key datagrams are now rejected
    old = b.encrypt(b"old key")
    a.remove(K1)
    with pytest.raises(WrongKeyError):
        a.decrypt(old)
    b.use(K2)
    b.remove(K1)
    assert a.decrypt(b.encrypt(b"new")) == b"new"
    assert a.keys() == b.keys() == [K2]


def test_key_operations_refused() -> None:
    ring = Keyring(K1, [K2])
    with pytest.raises(KeyOperationError, match="primary"):
        ring.remove(K1)
    with pytest.raises(KeyOperationError, match="install"):
        ring.use(K3)
    with pytest.raises(KeyOperationError, match="not installed"):
        ring.remove(K3)
    with pytest.raises(KeyOperationError):
        ring.install(b"short")
    ring.install(K2)  # idempotent
    assert ring.keys() == [K1, K2]


def test_key_text_form() -> None:
    key = generate_key()
    assert parse_key(encode_key(key)) == key
    for bad in ("not base64!", encode_key(b"x" * 20), ""):
        with pytest.raises(KeyOperationError):
            parse_key(bad)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_fuzz_only_keyring_errors(data: bytes) -> None:
    ring = Keyring(K1, [K2])
    with pytest.raises(KeyringError):
        ring.decrypt(data)
