"""One HTTP health check, as ifurlup does it: GET the URL pinned to one address.

The request goes to the target address with the check host in the ``Host`` header (the
URL's host is never resolved), a fresh connection each time (a kept-alive connection
could hide a dead listener), a total timeout, and a bounded body read. Healthy means
status 200 and ``expect`` somewhere in the body: a case-sensitive substring test, like
PowerDNS's ``stringmatch``.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

import aiohttp

MAX_BODY = 65_536


@dataclass(frozen=True, slots=True)
class CheckTarget:
    address: str
    port: int
    host: str  # Host header, with ":port" unless the port is the scheme's default
    path: str

    @property
    def url(self) -> str:
        return f"http://{self.host}{self.path}"

    @property
    def request_url(self) -> str:
        ip = ipaddress.ip_address(self.address)
        authority = f"[{ip}]" if ip.version == 6 else str(ip)
        return f"http://{authority}:{self.port}{self.path}"


async def probe(session: aiohttp.ClientSession, target: CheckTarget, *, timeout: float, expect: str,
                user_agent: str) -> tuple[bool, str]:
    """Run one check; returns (healthy, detail). Never raises except on cancellation."""
    try:
        async with asyncio.timeout(timeout):
            async with session.get(
                target.request_url, headers={"Host": target.host, "User-Agent": user_agent},
                allow_redirects=False,
            ) as response:
                body = await response.content.read(MAX_BODY)
    except TimeoutError:
        return False, f"timeout after {timeout:g} s"
    except aiohttp.ClientConnectorError as exc:
        return False, f"connect: {exc.os_error.strerror or exc.os_error}"[:200]
    except aiohttp.ClientError as exc:
        return False, f"{type(exc).__name__}: {exc}"[:200]
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}"[:200]
    if response.status != 200:
        return False, f"http {response.status}"
    if expect.encode() not in body:
        return False, f"body lacks {expect!r}"
    return True, "ok"


def new_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(force_close=True, limit=0, use_dns_cache=False)
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                 timeout=aiohttp.ClientTimeout(total=None))
