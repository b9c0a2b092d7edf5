"""set_port_sharing puts SO_REUSEADDR and SO_REUSEPORT as asked and believes only the kernel's answer."""

from __future__ import annotations

import socket

import pytest

from region_agent.base.sockets import PortSharingError, port_sharing, set_port_sharing


@pytest.mark.parametrize("share", [True, False])
def test_both_options_follow_share(share: bool) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(not share))
        set_port_sharing(sock, share=share)
        assert port_sharing(sock) == {"SO_REUSEADDR": share, "SO_REUSEPORT": share}


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
