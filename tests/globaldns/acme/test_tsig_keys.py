"""The TSIG keys file watcher: a refused file keeps the keys in use, counts, and is a problem until fixed."""

from __future__ import annotations

import base64
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from region_agent.globaldns.acme.service import AcmeConfig, AcmeUpdates
from region_agent.globaldns.acme.tsig import KeySpec, TsigKeyring
from region_agent.globaldns.acme.tsig_keys import TsigKeysWatcher, build_keyring
from region_agent.globaldns.tables import ZoneHolder
from region_agent.state.hlc import HybridClock
from region_agent.state.store import Store

SECRET = base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
STATIC = [KeySpec("inline-key", "hmac-sha256", SECRET)]


def _keys(*names: str) -> str:
    return "".join(f"{name}: {{algorithm: hmac-sha256, secret: {SECRET}}}\n" for name in names)


def _names(keyring: TsigKeyring) -> set[str]:
    return {name.to_text() for name in keyring.keys}


def test_a_refused_file_keeps_the_keys_and_is_a_problem_until_fixed(tmp_path: Path) -> None:
    path = tmp_path / "tsig.yaml"
    path.write_text(_keys("acme-key"))
    registry = CollectorRegistry()
    store = Store(writer="acme/t", clock=HybridClock(lambda: int(time.time() * 1000)))
    acme = AcmeUpdates(store, ZoneHolder(), AcmeConfig("g.example.com", build_keyring(STATIC, path), "acme/t"),
                       registry)
    watcher = TsigKeysWatcher(path, STATIC, acme, registry)
    assert not watcher.check() and watcher.problems() == ()  # the first read: nothing changed
    path.write_text("acme-key: {algorithm: hmac-sha256, secret: 'not base64!'}\n")
    assert not watcher.check()
    assert not watcher.check()  # read again: the file may be half-written
    assert _names(acme.config.keyring) == {"inline-key.", "acme-key."}
    assert registry.get_sample_value("region_agent_dns_tsig_keys_file_errors_total") == 2
    problem = watcher.problem
    assert problem is not None and str(path) in problem
    assert watcher.problems() == (f"TSIG keys file refused, keeping the current keys: {problem}",)
    path.write_text(_keys("acme-key", "new-key"))
    assert watcher.check() and watcher.problems() == ()
    assert _names(acme.config.keyring) == {"inline-key.", "acme-key.", "new-key."}
    assert registry.get_sample_value("region_agent_dns_tsig_keys_file_reloads_total") == 1
