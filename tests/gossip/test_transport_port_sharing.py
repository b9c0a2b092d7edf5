"""The gossip UDP socket is nobody else's to share, on uvloop too (a squatter would read our datagrams).

As for DNS (tests/globaldns/test_server_port_sharing.py): uvloop turns SO_REUSEADDR on, the
transport turns it off and reads it back; a forked squatter as nobody or as us is refused, and with
the option left on the same squatter binds.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from region_agent.base.sockets import PortSharingError, port_sharing
from region_agent.gossip import transport as transport_module
from region_agent.gossip.keyring import Keyring
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.transport import GossipTransport
from tests.fakes.ports import free_port
from tests.fakes.squatter import NOBODY, squat

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a squatter under another uid needs root")

KEY = b"k" * 32
RUNNERS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run}
try:
    import uvloop

    RUNNERS["uvloop"] = uvloop.run
except ImportError:  # uvloop is optional off Linux/macOS
    pass


async def _start(host: str = "127.0.0.2") -> GossipTransport:
    return await GossipTransport.start(host, 0, Keyring(KEY), GossipStats())


async def _squatters_refused() -> None:
    transport = await _start()
    try:
        udp = transport.packets._udp
        assert udp is not None
        assert port_sharing(udp.get_extra_info("socket")) == {"SO_REUSEADDR": False, "SO_REUSEPORT": False}
        for uid in (NOBODY, 0):
            for address in ("127.0.0.2", "0.0.0.0"):
                result = squat(address, transport.addr.port, uid=uid)
                assert (result.uid, result.errno) == (uid, errno.EADDRINUSE), (address, uid)
    finally:
        await transport.close()


@pytest.mark.parametrize("loop", list(RUNNERS))
def test_a_squatter_under_any_uid_can_not_bind_beside_gossip(loop: str) -> None:
    RUNNERS[loop](_squatters_refused())


@pytest.mark.skipif("uvloop" not in RUNNERS, reason="uvloop is what turns SO_REUSEADDR on")
def test_with_the_option_left_on_the_squatter_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_module, "set_port_sharing", lambda sock, share=False: None)

    async def scenario() -> None:
        transport = await _start()
        try:
            result = squat("127.0.0.2", transport.addr.port, uid=NOBODY)
            assert (result.uid, result.errno) == (NOBODY, 0)
        finally:
            await transport.close()

    uvloop.run(scenario())


async def test_options_that_will_not_go_off_fail_the_start_and_free_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(sock: object, share: bool = False) -> None:
        raise PortSharingError("SO_REUSEADDR still on after setting it off")

    port = free_port(("127.0.0.2",))
    monkeypatch.setattr(transport_module, "set_port_sharing", refuse)
    with pytest.raises(PortSharingError, match="SO_REUSEADDR still on"):
        await GossipTransport.start("127.0.0.2", port, Keyring(KEY), GossipStats())
    monkeypatch.undo()
    await asyncio.sleep(0)  # the closed UDP transport lets its socket go on the next loop turn
    transport = await GossipTransport.start("127.0.0.2", port, Keyring(KEY), GossipStats())  # TCP and UDP free
    await transport.close()
