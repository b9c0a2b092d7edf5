"""Reading a running agent's operator listener from the CLI (``zone``, ``geoip``, ``members``, ...)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MAX_BYTES = 256 * 1024 * 1024   # a /zone of 10,000 projects is ~5 MB; anything near this is not an agent


class CliError(Exception):
    """The agent could not be read; the message names the URL and says why (one line for stderr)."""


def fetch_json(url: str, token_file: str | None) -> dict[str, Any]:
    """GET a JSON object, with the operator bearer token from ``token_file`` when given."""
    request = urllib.request.Request(url)
    try:
        if token_file:
            token = Path(token_file).read_text(encoding="utf-8").strip()
            request.add_header("Authorization", f"Bearer {token}")
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
