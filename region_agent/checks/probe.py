"""One HTTP health check, as ifurlup does it: GET the URL pinned to one address.

The request goes to the target address with the check host in the ``Host`` header (the
URL's host is never resolved), a fresh connection each time (a kept-alive connection
could hide a dead listener), a total timeout, and a bounded body read. Healthy means
status 200 and ``expect`` somewhere in the body: a case-sensitive substring test, like
PowerDNS's ``stringmatch``.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import ipaddress
from dataclasses import dataclass

import aiohttp

MAX_BODY = 65_536

# Errors that say *this* process could not try (no descriptors, no buffers, no memory, no
# local port), so they are evidence about the agent, never about the remote copy.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})


class Outcome(enum.Enum):
    UP = "up"
    DOWN = "down"
    LOCAL_ERROR = "local-error"  # the check could not be made here; the target's state stays


@dataclass(frozen=True, slots=True)
class ProbeResult:
    outcome: Outcome
    detail: str

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.UP


def _os_error_result(error: OSError, prefix: str) -> ProbeResult:
    outcome = Outcome.LOCAL_ERROR if error.errno in LOCAL_ERRNOS else Outcome.DOWN
    return ProbeResult(outcome, f"{prefix}{error.strerror or error}"[:200])


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
                user_agent: str) -> ProbeResult:
    """Run one check. Never raises except on cancellation."""
    try:
        async with asyncio.timeout(timeout):
            async with session.get(
                target.request_url, headers={"Host": target.host, "User-Agent": user_agent},
                allow_redirects=False,
            ) as response:
                body = await response.content.read(MAX_BODY)
    except TimeoutError:
        return ProbeResult(Outcome.DOWN, f"timeout after {timeout:g} s")
    except aiohttp.ClientConnectorError as exc:
        return _os_error_result(exc.os_error, "connect: ")
    except aiohttp.ClientOSError as exc:
        return _os_error_result(exc, f"{type(exc).__name__}: ")
    except aiohttp.ClientError as exc:
        return ProbeResult(Outcome.DOWN, f"{type(exc).__name__}: {exc}"[:200])
    except OSError as exc:  # raised before aiohttp wraps it, e.g. socket() itself failing
        return _os_error_result(exc, f"{type(exc).__name__}: ")
    if response.status != 200:
        return ProbeResult(Outcome.DOWN, f"http {response.status}")
    if expect.encode() not in body:
        return ProbeResult(Outcome.DOWN, f"body lacks {expect!r}")
    return ProbeResult(Outcome.UP, "ok")


def new_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(force_close=True, limit=0, use_dns_cache=False)
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                 timeout=aiohttp.ClientTimeout(total=None))
