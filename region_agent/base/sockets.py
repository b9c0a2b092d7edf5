"""Port sharing on a bound socket: ``SO_REUSEADDR`` and ``SO_REUSEPORT`` set as asked, and checked.

A UDP socket with ``SO_REUSEADDR`` lets any other socket that sets it too bind the same address
and port, whatever its uid, and take part of the traffic; ``SO_REUSEPORT`` does the same for the
same uid. uvloop (libuv's ``uv_udp_open``) turns ``SO_REUSEADDR`` on for every socket it is handed,
so the listeners call :func:`set_port_sharing` on the socket the event loop holds, after it took it.
``share=True`` is for processes of one agent sharing a port on purpose (``dns.workers``): it turns
``SO_REUSEPORT`` on and keeps ``SO_REUSEADDR`` off, so the kernel lets only sockets of the same uid
join (Linux requires every socket of a ``SO_REUSEPORT`` group to have the same effective uid, root
included); ``SO_REUSEADDR`` on two UDP sockets would let any uid in.
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
    """``SO_REUSEADDR`` off, ``SO_REUSEPORT`` to ``share``, read back; :class:`PortSharingError` if either differs."""
    wanted = {"SO_REUSEADDR": False, "SO_REUSEPORT": share}
    for name, option in OPTIONS:
        if option is None:
            continue
        if bool(sock.getsockopt(socket.SOL_SOCKET, option)) != wanted[name]:
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, int(wanted[name]))
            except OSError as exc:
                raise PortSharingError(f"{name} can not be turned {'on' if wanted[name] else 'off'}: {exc}") from exc
    wrong = [name for name, on in port_sharing(sock).items() if on != wanted[name]]
    if wrong:
        was, asked = ("on", "off") if not wanted[wrong[0]] else ("off", "on")
        raise PortSharingError(f"{' and '.join(wrong)} still {was} after setting it {asked}")


def source_key(address: str) -> str:
    """Whose share a connection counts against: the IPv4 address, or the IPv6 /64 (one host's usual allocation)."""
    if ":" not in address:
        return address
    try:
        return str(ipaddress.IPv6Network((address.partition("%")[0], 64), strict=False))
    except ValueError:
        return address
