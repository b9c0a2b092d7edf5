"""``region-agent run`` refuses to start when it can not own its DNS socket: exit 2, one line.

The squatter is the case from issue 7: a process that bound the UDP port first with
SO_REUSEADDR. The agent's UDP socket does not set it, so the bind fails instead of the two
sharing the port (and the squatter receiving part of the queries).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run_agent(tmp_path: Path, listen: str, port: int) -> subprocess.CompletedProcess[str]:
    (tmp_path / "zone.yaml").write_text("regions: {sfo1: {ipv4: [127.0.0.41]}}\nprojects: {shop: {regions: [sfo1]}}\n")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        http_port = probe.getsockname()[1]
    config = tmp_path / "agent.yaml"
    config.write_text(f"""
region: sfo1
zone_file: zone.yaml
dns: {{zone: g.example.com, listen_addresses: [{listen}], port: {port}}}
health: {{listen_addresses: [127.0.0.1], port: {http_port}}}
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGION_AGENT_")}
    return subprocess.run([sys.executable, "-m", "region_agent", "run", "--config", str(config)], capture_output=True,
                          text=True, timeout=30, env=env, check=False, cwd=REPO)


def _error_lines(stderr: str) -> list[str]:
    """What the agent printed beyond its JSON log lines."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("{")]


def test_a_udp_squatter_with_so_reuseaddr_stops_start_up(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", 0))
        port = squatter.getsockname()[1]
        result = _run_agent(tmp_path, "127.0.0.1", port)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert _error_lines(result.stderr) == [
        f"region-agent: dns.port: can not listen on 127.0.0.1 port {port}/udp: address already in use "
        "(another process holds this port)"]


def test_an_address_this_host_does_not_have_stops_start_up(tmp_path: Path) -> None:
    address = "192.0.2.1"  # TEST-NET-1: on no interface here
    result = _run_agent(tmp_path, address, 5353)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = _error_lines(result.stderr)
    assert line.startswith(f"region-agent: dns.listen_addresses: can not listen on {address} port 5353/udp")
