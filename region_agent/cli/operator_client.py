"""Reading a running agent's operator listener from the CLI (``zone``, ``geoip``, ``members``, ...)."""

from __future__ import annotations

import argparse
import ipaddress
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MAX_BYTES = 256 * 1024 * 1024   # a /zone of 10,000 projects is ~5 MB; anything near this is not an agent
DEFAULT_URL = "http://127.0.0.1:8087"


class CliError(Exception):
    """The agent could not be read; the message names the URL and says why (one line for stderr)."""


def read_token(token_file: str | Path) -> str:
    """The operator token in ``token_file``; :class:`CliError` naming the file when it can not be used."""
    try:
        token = Path(token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise CliError(f"token file {token_file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CliError(f"token file {token_file}: not UTF-8 text") from None
    if not token:
        raise CliError(f"token file {token_file}: empty")
    return token


def fetch_json(url: str, token_file: str | Path | None) -> dict[str, Any]:
    """GET a JSON object, with the operator bearer token from ``token_file`` when given."""
    request = urllib.request.Request(url)
    if token_file:
        request.add_header("Authorization", f"Bearer {read_token(token_file)}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read(MAX_BYTES + 1)
        if len(body) > MAX_BYTES:
            raise CliError(f"{url}: answer over {MAX_BYTES} bytes")
        data = json.loads(body)
    except urllib.error.HTTPError as exc:
        detail = exc.read(2048).decode(errors="replace").strip()
        raise CliError(f"{url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CliError(f"can not read {url}: {exc}") from None
    if not isinstance(data, dict):
        raise CliError(f"{url}: not a JSON object")
    return data


def operator_url(addresses: tuple[str, ...] | list[str], port: int) -> str:
    """The URL of an operator listener on ``addresses`` (the first; a wildcard is reached on loopback)."""
    host = addresses[0] if addresses else "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"http://{host}:{port}"


def operator_target(args: argparse.Namespace) -> tuple[str, str | None]:
    """The operator listener's URL and token file for an inspection command: ``--url`` and
    ``--token-file`` when given, else from the agent's settings (``--config``: the operator listener's
    address and port, ``health.operator_token_file``), else the defaults."""
    url: str | None = getattr(args, "url", None)
    token_file: str | None = getattr(args, "token_file", None)
    config: str | None = getattr(args, "config", None)
    if config and (url is None or token_file is None):
        from region_agent.app.settings import load_settings  # SettingsError: exit 2, one line

        health = load_settings(Path(config)).health
        if url is None:
            url = operator_url(health.operator_listen_addresses, health.operator_port)
        if token_file is None and health.operator_token_file is not None:
            token_file = str(health.operator_token_file)
    return (url or DEFAULT_URL).rstrip("/"), token_file


def add_operator_arguments(parser: argparse.ArgumentParser, *, default: Any = None) -> None:
    """``--config``, ``--url`` and ``--token-file`` of the commands that read a running agent."""
    parser.add_argument("--config", default=default,
                        help="the agent's settings file: the operator listener's address and port and "
                        "health.operator_token_file come from it (--url and --token-file win)")
    parser.add_argument("--url", default=default,
                        help=f"the agent's operator listener (default {DEFAULT_URL}, or from --config)")
    parser.add_argument("--token-file", default=default,
                        help="bearer token for the operator listener (the agent's health.operator_token_file; "
                        "default from --config)")
