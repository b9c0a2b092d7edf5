"""Real issuance with Debian 12's certbot 2.1 and its RFC 2136 plugin against the agent, Pebble as the CA.

certbot 1.32-2.5 signs the SOA lookup that finds the zone and rejects an answer whose TSIG does
not verify; before the agent signed its answers to signed queries this failed with "Unable to
determine base domain". Pebble (Debian's package, an ACME test CA) validates the DNS-01
challenge by asking the agent itself (``-dnsserver``). Everything stays on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent
from tests.conftest import wait_for
from tests.fakes.ports import free_port

CERTBOT = "/usr/bin/certbot"
ZONE = "g.example.com"
SECRET = base64.b64encode(b"certbot-rfc2136-secret-012345678").decode()
ZONE_FILE = ("regions: {sfo1: {ipv4: [127.0.0.51], ns_ipv4: [127.0.0.53]}}\n"
             "projects: {shop: {regions: [sfo1]}}\n")

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(not (os.path.exists(CERTBOT) and shutil.which("pebble") and shutil.which("openssl")),
                       reason="certbot, python3-certbot-dns-rfc2136 and pebble are Debian packages "
                              "(scripts/system-packages.sh)"),
]



@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    zone = tmp_path / "zone.yaml"
    zone.write_text(ZONE_FILE)
    running = Agent(AgentSettings(
        region="sfo1", zone_file=zone,
        dns={"zone": ZONE, "listen_addresses": ["127.0.0.1"], "port": 0,
             "acme": {"tsig_keys": [{"name": "certbot-key", "algorithm": "hmac-sha256", "secret": SECRET}]}},
        health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


async def _run(*argv: str, env: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.STDOUT, env=env)
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        out, _ = await process.communicate()
        return -1, out.decode(errors="replace")
    return process.returncode or 0, out.decode(errors="replace")


async def _tls_pair(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    code, out = await _run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                           "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                           "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost")
    assert code == 0, out
    return cert, key


@pytest.fixture
async def pebble(tmp_path: Path, agent: Agent) -> AsyncIterator[tuple[str, Path]]:
    """A Pebble CA that validates DNS-01 by asking the agent; yields its directory URL and TLS certificate."""
    cert, key = await _tls_pair(tmp_path)
    port = free_port()
    config = tmp_path / "pebble.json"
    config.write_text(f'{{"pebble": {{"listenAddress": "127.0.0.1:{port}", "managementListenAddress": '
                      f'"127.0.0.1:{free_port()}", "certificate": "{cert}", "privateKey": "{key}", '
                      f'"httpPort": {free_port()}, "tlsPort": {free_port()}, "ocspResponderURL": "", '
                      f'"externalAccountBindingRequired": false}}}}')
    env = {**os.environ, "PEBBLE_VA_NOSLEEP": "1", "PEBBLE_WFE_NONCEREJECT": "0", "PEBBLE_AUTHZREUSE": "0"}
    process = await asyncio.create_subprocess_exec(
        "pebble", "-config", str(config), "-dnsserver", f"127.0.0.1:{agent.dns.server.bound[0][1]}",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=env)

    async def listening() -> bool:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return False
        writer.close()
        return True
    try:
        await wait_for(listening, timeout=15, message="pebble listening")
        yield f"https://127.0.0.1:{port}/dir", cert
    finally:
        process.kill()
        await process.wait()


async def test_debian_certbot_2_1_issues_a_wildcard_certificate_through_the_agent(
        tmp_path: Path, agent: Agent, pebble: tuple[str, Path]) -> None:
    await wait_for(agent.ready.is_set, timeout=10, message="ready")
    directory, ca = pebble
    credentials = tmp_path / "rfc2136.ini"
    credentials.write_text(f"dns_rfc2136_server = 127.0.0.1\ndns_rfc2136_port = {agent.dns.server.bound[0][1]}\n"
                           f"dns_rfc2136_name = certbot-key\ndns_rfc2136_secret = {SECRET}\n"
                           "dns_rfc2136_algorithm = HMAC-SHA256\n")
    credentials.chmod(0o600)
    state = tmp_path / "certbot"
    env = {**os.environ, "REQUESTS_CA_BUNDLE": str(ca)}
    code, out = await _run(
        CERTBOT, "certonly", "--non-interactive", "--agree-tos", "--register-unsafely-without-email",
        "--server", directory, "--config-dir", str(state / "config"), "--work-dir", str(state / "work"),
        "--logs-dir", str(state / "logs"), "--dns-rfc2136", "--dns-rfc2136-credentials", str(credentials),
        "--dns-rfc2136-propagation-seconds", "1", "-d", f"shop.{ZONE}", "-d", f"*.{ZONE}",
        env=env, timeout=180)
    log = (state / "logs" / "letsencrypt.log")
    assert code == 0, out + (log.read_text()[-4000:] if log.exists() else "")
    issued = state / "config" / "live" / f"shop.{ZONE}" / "fullchain.pem"
    assert issued.read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert agent.registry.get_sample_value("region_agent_dns_signed_queries_total", {"result": "ok"})

    async def cleaned_up() -> bool:
        return not agent.store.challenges  # certbot deleted both challenge records
    await wait_for(cleaned_up, timeout=10, message="challenges deleted")
