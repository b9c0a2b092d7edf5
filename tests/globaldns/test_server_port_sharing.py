"""The DNS UDP socket is nobody else's to share, on uvloop too (issue: a squatter took 5 of 20 queries).

uvloop turns SO_REUSEADDR on for a UDP socket it is handed; the server turns it off again and reads
it back. A squatter is a forked child under another uid (nobody) or ours, asking for SO_REUSEADDR and
SO_REUSEPORT. With the options left as uvloop sets them, the same squatter binds: the test can fail.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from region_agent.base.sockets import PortSharingError, port_sharing
from region_agent.globaldns import server as server_module
from region_agent.globaldns.answer import Responder
from region_agent.globaldns.metrics import DnsCounters
from region_agent.globaldns.server import BindError, DnsServer
from region_agent.globaldns.tables import ZoneHolder
from tests.fakes.dns_client import ask
from tests.fakes.squatter import NOBODY, squat
from tests.globaldns.test_server import _tables
from tests.globaldns.zones import ZONE

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a squatter under another uid needs root")

RUNNERS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run}
try:
    import uvloop

    RUNNERS["uvloop"] = uvloop.run
except ImportError:  # uvloop is optional off Linux/macOS
    pass


def _server(host: str = "127.0.0.1", port: int = 0) -> DnsServer:
    return DnsServer(Responder(ZoneHolder(_tables()), DnsCounters()), [(host, port)])  # type: ignore[arg-type]


async def _squatters_refused(host: str) -> None:
    srv = _server(host)
    await srv.start()
    try:
        (udp,) = srv._udp
        assert port_sharing(udp.get_extra_info("socket")) == {"SO_REUSEADDR": False, "SO_REUSEPORT": False}
        port = srv.bound[0][1]
        for uid in (NOBODY, 0):
            for address in (host, "0.0.0.0" if ":" not in host else "::"):
                result = squat(address, port, uid=uid)
                assert (result.uid, result.errno) == (uid, errno.EADDRINUSE), (address, uid)
        assert (await ask(port, f"shop.{ZONE}", host=host)).answer  # still ours, still answering
    finally:
        await srv.stop()


@pytest.mark.parametrize("loop", list(RUNNERS))
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_squatter_under_any_uid_can_not_bind_beside_the_server(loop: str, host: str) -> None:
    RUNNERS[loop](_squatters_refused(host))


@pytest.mark.skipif("uvloop" not in RUNNERS, reason="uvloop is the loop the agent runs")
def test_with_the_options_left_on_the_squatter_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old behaviour: SO_REUSEADDR left on (as uvloop's transport set it) lets nobody's squatter in.

    No transport takes the UDP socket any more (``UdpListener``), so the option is put on here.
    """
    monkeypatch.setattr(server_module, "set_port_sharing",
                        lambda sock, share=False: sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1))

    async def scenario() -> None:
        srv = _server()
        await srv.start()
        try:
            (udp,) = srv._udp
            assert port_sharing(udp.get_extra_info("socket"))["SO_REUSEADDR"]
            result = squat("127.0.0.1", srv.bound[0][1], uid=NOBODY)
            assert (result.uid, result.errno) == (NOBODY, 0)
        finally:
            await srv.stop()

    uvloop.run(scenario())


async def test_options_that_will_not_go_off_fail_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(sock: object, share: bool = False) -> None:
        raise PortSharingError("SO_REUSEADDR still on after setting it off")

    monkeypatch.setattr(server_module, "set_port_sharing", refuse)
    srv = _server()
    with pytest.raises(BindError) as caught:
        await srv.start()
    assert "SO_REUSEADDR still on" in str(caught.value) and str(caught.value).startswith("dns.port: ")
    assert srv.bound == [] and srv._udp == []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # the half-open socket was closed
        probe.bind(("127.0.0.1", 0))
