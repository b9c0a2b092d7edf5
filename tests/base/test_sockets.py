"""set_port_sharing puts SO_REUSEADDR and SO_REUSEPORT as asked and believes only the kernel's answer."""

from __future__ import annotations

import socket

import pytest

from region_agent.base.sockets import PortSharingError, port_sharing, set_port_sharing


@pytest.mark.parametrize("share", [True, False])
def test_reuseport_follows_share_and_reuseaddr_stays_off(share: bool) -> None:
    """SO_REUSEADDR is never on: on two UDP sockets it lets any uid share the port; SO_REUSEPORT only the same uid."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(not share))
        set_port_sharing(sock, share=share)
        assert port_sharing(sock) == {"SO_REUSEADDR": False, "SO_REUSEPORT": share}


class Stuck:
    """A socket whose options do not change (what a loop's stand-in might do)."""

    def getsockopt(self, level: int, optname: int, /) -> int:
        return 1

    def setsockopt(self, level: int, optname: int, value: int, /) -> None:
        pass


class Refusing(Stuck):
    def setsockopt(self, level: int, optname: int, value: int, /) -> None:
        raise OSError(95, "Operation not supported")


def test_an_option_that_stays_on_is_an_error() -> None:
    with pytest.raises(PortSharingError, match=r"^SO_REUSEADDR and SO_REUSEPORT still on after setting it off$"):
        set_port_sharing(Stuck())


def test_a_refused_setsockopt_is_an_error() -> None:
    with pytest.raises(PortSharingError, match=r"^SO_REUSEADDR can not be turned off: .*not supported"):
        set_port_sharing(Refusing())
