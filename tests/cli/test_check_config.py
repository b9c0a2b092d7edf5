"""``check-config`` makes the checks ``run`` makes short of binding: each bad file is refused by both, in the
same one line, exit 2; listener conflicts among the configured addresses too; the printed settings hide
every secret. A taken health port stops ``run`` with one line, exit 2, at once."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from region_agent.app.settings import load_settings
from region_agent.app.supervisor import Agent
from region_agent.cli import main as cli_main
from region_agent.cli.main import main
from tests.fakes.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SECRET = "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LTEyMzQ="  # base64 of 32 bytes
ZONE = "regions: {sfo1: {ipv4: [127.0.0.41]}}\nprojects: {shop: {regions: [sfo1]}}\n"
Config = dict[str, Any]


@pytest.fixture(autouse=True)
def _restore_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--config`` sets REGION_AGENT_CONFIG in the process; later tests must not read that file."""
    monkeypatch.setenv("REGION_AGENT_CONFIG", "")
    for name in [n for n in os.environ if n.startswith("REGION_AGENT_") and n != "REGION_AGENT_CONFIG"]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _never_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config these tests mean ``run`` to refuse must be refused before the agent starts."""
    def refuse(coro: Coroutine[Any, Any, int]) -> int:
        coro.close()
        pytest.fail("run started the agent: the config was not refused")
    monkeypatch.setattr(cli_main, "_run", refuse)



@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A keyring, a CA and identity certificates for sfo1/n1 and lax1/n1."""
    base = tmp_path_factory.mktemp("pki")
    assert main(["keys", "init", "--dir", str(base)]) == 0
    for region in ("sfo1", "lax1"):
        assert main(["keys", "cert", "--ca-dir", str(base), "--region", region, "--node", "n1",
                     "--out", str(base)]) == 0
    return base


def standalone(tmp: Path) -> Config:
    (tmp / "zone.yaml").write_text(ZONE)
    return {"region": "sfo1", "node": "n1", "zone_file": "zone.yaml",
            "dns": {"zone": "g.example.com", "listen_addresses": ["127.0.0.1"], "port": free_port()},
            "health": {"listen_addresses": ["127.0.0.1"], "port": free_port(), "operator_port": free_port()}}


def clustered(tmp: Path, pki: Path) -> Config:
    config = standalone(tmp)
    config["gossip"] = {"enabled": True, "bind_address": "127.0.0.1", "port": free_port(),
                        "keyring_file": str(pki / "keyring.json"), "tls_ca_file": str(pki / "ca.pem"),
                        "tls_cert_file": str(pki / "sfo1-n1.pem"), "tls_key_file": str(pki / "sfo1-n1-key.pem")}
    return config


def write(tmp: Path, config: Config) -> str:
    path = tmp / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def one_line_refusal(capsys: pytest.CaptureFixture[str], command: str, config: str) -> str:
    assert main([command, "--config", config]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("region-agent: "), err
    return err


# --- each bad config: refused by check-config and by run, the same line ----------------------------------------

def tsig_inline(secret: str, algorithm: str = "hmac-sha256") -> Callable[[Path, Path], Config]:
    def make(tmp: Path, _pki: Path) -> Config:
        config = standalone(tmp)
        config["dns"]["acme"] = {"tsig_keys": [{"name": "acme-key", "algorithm": algorithm, "secret": secret}]}
        return config
    return make


def tsig_file(tmp: Path, _pki: Path) -> Config:
    (tmp / "tsig.yaml").write_text("acme-key: {algorithm: hmac-sha256, secret: '!!not base64!!'}\n")
    config = standalone(tmp)
    config["dns"]["acme"] = {"tsig_keys_file": str(tmp / "tsig.yaml")}
    return config


def keyring_broken(tmp: Path, pki: Path) -> Config:
    (tmp / "keyring.json").write_text("{not json")
    config = clustered(tmp, pki)
    config["gossip"]["keyring_file"] = str(tmp / "keyring.json")
    return config


def cert_missing(tmp: Path, pki: Path) -> Config:
    config = clustered(tmp, pki)
    config["gossip"]["tls_cert_file"] = str(tmp / "absent.pem")
    return config


def key_of_another_cert(tmp: Path, pki: Path) -> Config:
    config = clustered(tmp, pki)
    config["gossip"]["tls_key_file"] = str(pki / "lax1-n1-key.pem")
    return config


def cert_of_another_region(tmp: Path, pki: Path) -> Config:
    config = clustered(tmp, pki)
    config["region"] = "lax1"
    return config


def same_port(first: tuple[str, str], second: tuple[str, str]) -> Callable[[Path, Path], Config]:
    """Two port settings given one port (``section.field`` each)."""
    def make(tmp: Path, pki: Path) -> Config:
        config = clustered(tmp, pki)
        port = free_port()
        for section, field in (first, second):
            config[section][field] = port
        return config
    return make


def wildcard_over_operator(tmp: Path, pki: Path) -> Config:
    config = standalone(tmp)
    port = free_port()
    config["health"].update(listen_addresses=["0.0.0.0"], port=port, operator_listen_addresses=["127.0.0.1"],
                            operator_port=port)
    return config


BAD = {
    "bad base64 inline TSIG secret": (tsig_inline("!!not base64!!"), "dns.acme.tsig_keys: TSIG key 'acme-key'"),
    "unknown TSIG algorithm": (tsig_inline(SECRET, "hmac-sha3"), "algorithm 'hmac-sha3' is not one of"),
    "bad TSIG keys file": (tsig_file, "dns.acme.tsig_keys_file"),
    "keyring file not JSON": (keyring_broken, "gossip.keyring_file:"),
    "certificate file missing": (cert_missing, "gossip.tls_*:"),
    "key of another certificate": (key_of_another_cert, "gossip.tls_*:"),
    "identity of another region": (cert_of_another_region, "the certificate names sfo1/n1, not this agent (lax1/n1)"),
    "health.port == dns.port": (same_port(("dns", "port"), ("health", "port")),
                                "dns.port (127.0.0.1 port"),
    "operator_port == port": (same_port(("health", "port"), ("health", "operator_port")),
                              "health.port (127.0.0.1 port"),
    "gossip.port == dns.port": (same_port(("dns", "port"), ("gossip", "port")), "gossip.port (127.0.0.1 port"),
    "0.0.0.0 over a specific address": (wildcard_over_operator, "health.port (0.0.0.0 port"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_check_config_and_run_refuse_it_in_the_same_line(case: str, tmp_path: Path, pki: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    make, expected = BAD[case]
    config = write(tmp_path, make(tmp_path, pki))
    checked = one_line_refusal(capsys, "check-config", config)
    assert expected in checked
    assert one_line_refusal(capsys, "run", config) == checked


def test_listener_conflicts_name_both_settings(tmp_path: Path, pki: Path) -> None:
    config = same_port(("dns", "port"), ("health", "port"))(tmp_path, pki)
    with pytest.raises(ValueError, match=r"listener conflict: dns\.port .* and health\.port .*/tcp\)"):
        load_settings(Path(write(tmp_path, config)))


def test_addresses_apart_share_a_port(tmp_path: Path, pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a conflict: other addresses, other protocols, IPv6 beside IPv4, port 0."""
    config = clustered(tmp_path, pki)
    port = free_port()
    config["health"].update(listen_addresses=["127.0.0.2", "::"], port=port, operator_port=port)
    config["gossip"]["port"] = config["dns"]["port"]
    config["gossip"]["bind_address"] = "127.0.0.3"
    config["dns"]["port"] = 0
    assert main(["check-config", "--config", write(tmp_path, config)]) == 0, capsys.readouterr().err


def test_a_good_cluster_config_passes(tmp_path: Path, pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--config", write(tmp_path, clustered(tmp_path, pki))]) == 0
    assert '"region": "sfo1"' in capsys.readouterr().out


# --- secrets are never printed ---------------------------------------------------------------------------------

def test_the_printed_settings_hide_every_secret(tmp_path: Path, pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tsig_inline(SECRET)(tmp_path, pki)
    config["usage"] = {"token": "usage-t0ken-inline", "token_file": None}
    assert main(["check-config", "--config", write(tmp_path, config)]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out and "usage-t0ken-inline" not in out
    assert '"secret": "**********"' in out and '"token": "**********"' in out
    assert '"name": "acme-key"' in out  # the rest is shown


# --- a taken health port -------------------------------------------------------------------------------------

@pytest.fixture
def squatter() -> Iterator[int]:
    """A TCP port held by a listening socket not the agent's."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_run_with_the_health_port_taken_exits_2_in_one_line(tmp_path: Path, squatter: int) -> None:
    config = standalone(tmp_path)
    config["health"]["port"] = squatter
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGION_AGENT_")}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "region_agent", "run", "--config", write(tmp_path, config)],
                            capture_output=True, text=True, timeout=30, env=env, check=False, cwd=REPO)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if not line.startswith("{")] == [
        f"region-agent: health.port: can not listen on 127.0.0.1 port {squatter}/tcp: address already in use "
        "(another process holds this port); see also health.listen_addresses"]
    assert elapsed < 10, f"{elapsed:.1f} s to exit"  # the interpreter's start included; the agent's part below


@pytest.mark.parametrize("taken", ["dns", "health", "operator"])
async def test_a_failed_start_of_a_cluster_agent_ends_at_once(taken: str, tmp_path: Path, pki: Path,
                                                              squatter: int) -> None:
    """No loop runs before every port is bound, and nothing waits for the shutdown budget or a leave."""
    config = clustered(tmp_path, pki)
    config["gossip"]["seeds"] = [f"127.0.0.1:{free_port()}"]  # a join in flight, were it started
    if taken == "dns":
        config["dns"]["port"] = squatter
    else:
        config["health"]["port" if taken == "health" else "operator_port"] = squatter
    agent = Agent(load_settings(Path(write(tmp_path, config))))
    spawned: list[str] = []
    spawn = agent.tasks.spawn

    def recording_spawn(name: str, factory: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        spawned.append(name)
        spawn(name, factory)

    agent.tasks.spawn = recording_spawn  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(OSError, match="address already in use"):
        await asyncio.wait_for(agent.run(), 10)
    elapsed = time.monotonic() - started
    assert spawned == []
    assert elapsed < 1.0, f"{elapsed:.2f} s"  # a graceful gossip leave alone waits 1 s


async def test_a_feed_socket_that_can_not_be_made_names_the_setting(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from region_agent.health.listener import ListenError
    from region_agent.health.service import HealthService
    from region_agent.health.settings import HealthMode, HealthSettings

    (tmp_path / "file").write_text("")  # the socket's directory is a file
    settings = HealthSettings(mode=HealthMode.SIDECAR, operator_listen_addresses=("127.0.0.1",), operator_port=0,
                              feed_socket=tmp_path / "file" / "health.sock")
    service = HealthService(settings, region="sfo1", registry=CollectorRegistry())
    with pytest.raises(ListenError, match=r"^health\.feed_socket: can not listen on .*health\.sock: "):
        await service.start()
    assert service.operator.addresses == []  # what did bind is closed again
