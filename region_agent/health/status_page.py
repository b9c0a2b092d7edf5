"""The operator listener's ``/status``: one self-contained HTML page (``status.html``, inline CSS and JS).

The page holds no data: it is the same bytes for everyone, so it is served without the token
(like ``/livez``). Its script asks for the token in a small form, keeps it in the tab's
``sessionStorage`` and sends it as ``Authorization: Bearer`` on every fetch of ``/status.json``
(the data, behind the token like every operator path), which it polls every second. The token
never goes into a URL (``?token=`` would end up in browser history, proxies' logs and Referer
headers). Every string from the agent is put into the DOM with ``textContent``.

A Content-Security-Policy allows only the page's own inline script and style (by hash),
requests to this origin, and no framing, so nothing the page shows can run as code and no other
site can frame the token form.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

from region_agent.health.views import Answer, _base_headers

__all__ = ["HTML", "PATH", "page", "security_policy"]

PATH = "/status"
HTML = "text/html; charset=utf-8"


@cache
def _body() -> bytes:
    return resources.files("region_agent.health").joinpath("status.html").read_bytes()


def _hashes(tag: str, body: str) -> list[str]:
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", body, flags=re.DOTALL)
    return [f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks]


@cache
def security_policy() -> str:
    body = _body().decode()
    return ("default-src 'none'; "
            f"script-src {' '.join(_hashes('script', body))}; style-src {' '.join(_hashes('style', body))}; "
            "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def page(*, region: str, request_id: str) -> Answer:
    headers = _base_headers(region, request_id, HTML)
    headers["Content-Security-Policy"] = security_policy()
    headers["X-Frame-Options"] = "DENY"
    headers["X-Content-Type-Options"] = "nosniff"
    headers["Referrer-Policy"] = "no-referrer"
    return Answer(200, _body(), headers)
