"""Port sharing on a bound socket: ``SO_REUSEADDR`` and ``SO_REUSEPORT`` set as asked, and checked.

A UDP socket with ``SO_REUSEADDR`` lets any other socket that sets it too bind the same address
and port, whatever its uid, and take part of the traffic; ``SO_REUSEPORT`` does the same for the
same uid. uvloop (libuv's ``uv_udp_open``) turns ``SO_REUSEADDR`` on for every socket it is handed,
so the listeners call :func:`set_port_sharing` on the socket the event loop holds, after it took it.
``share=True`` is for processes of one agent sharing a port on purpose (a later ``dns.workers``).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Protocol

OPTIONS = (("SO_REUSEADDR", socket.SO_REUSEADDR), ("SO_REUSEPORT", getattr(socket, "SO_REUSEPORT", None)))


class HasSockopts(Protocol):
    """A socket, or the stand-in an event loop's transport gives out (uvloop's PseudoSocket)."""

    def getsockopt(self, level: int, optname: int, /) -> int: ...

    def setsockopt(self, level: int, optname: int, value: int, /) -> None: ...


class PortSharingError(OSError):
    """The options could not be put as asked: listening on would let another process share the port."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)

    def __str__(self) -> str:
        return str(self.strerror)


def port_sharing(sock: HasSockopts) -> dict[str, bool]:
    """What the kernel says now, by option name (an option the platform lacks is left out)."""
    return {name: bool(sock.getsockopt(socket.SOL_SOCKET, option)) for name, option in OPTIONS if option is not None}


def set_port_sharing(sock: HasSockopts, *, share: bool = False) -> None:
    """Put both options to ``share`` and read them back; raise :class:`PortSharingError` if either differs."""
    for name, option in OPTIONS:
        if option is None:
            continue
        if bool(sock.getsockopt(socket.SOL_SOCKET, option)) != share:
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, int(share))
            except OSError as exc:
                raise PortSharingError(f"{name} can not be turned {'on' if share else 'off'}: {exc}") from exc
    wrong = [name for name, on in port_sharing(sock).items() if on != share]
    if wrong:
        raise PortSharingError(f"{' and '.join(wrong)} still {'off' if share else 'on'} after setting it "
                               f"{'on' if share else 'off'}")


def source_key(address: str) -> str:
    """Whose share a connection counts against: the IPv4 address, or the IPv6 /64 (one host's usual allocation)."""
    if ":" not in address:
        return address
    try:
        return str(ipaddress.IPv6Network((address.partition("%")[0], 64), strict=False))
    except ValueError:
        return address
