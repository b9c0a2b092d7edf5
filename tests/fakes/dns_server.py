"""A fake name server for reachability tests: answers SOA over UDP, and nothing listens on TCP.

A name server reachable over one transport only (a firewall that passes UDP 53 and drops TCP 53)
is what the reachability check must tell apart from a working one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import dns.flags
import dns.message
import dns.rrset

from tests.fakes.ports import free_port

ZONE = "g.example.com"


def soa_rrset(zone: str = ZONE, owner: str | None = None) -> dns.rrset.RRset:
    """The zone's SOA as the agent serves it (MNAME ns-sfo1, TTL 3600, minimum 60), at ``owner`` if given."""
    return dns.rrset.from_text(f"{owner or zone}.", 3600, "IN", "SOA",
                               f"ns-sfo1.{zone}. hostmaster.{zone}. 1 3600 600 604800 60")


class UdpOnlySoa(asyncio.DatagramProtocol):
    """Answers every query with the zone's SOA over UDP, authoritatively; nothing listens on TCP."""

    def __init__(self, zone: str = ZONE) -> None:
        self.zone = zone
        self.transport: asyncio.DatagramTransport | None = None
        self.queries = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        response.answer.append(soa_rrset(self.zone))
        self.queries += 1
        assert self.transport is not None
        self.transport.sendto(response.to_wire(), addr)


@asynccontextmanager
async def udp_only_soa(zone: str = ZONE, host: str = "127.0.0.1") -> AsyncIterator[tuple[UdpOnlySoa, int]]:
    """A :class:`UdpOnlySoa` on a port free for TCP too (so TCP to it is refused): (server, port)."""
    port = free_port((host,))
    transport, protocol = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: UdpOnlySoa(zone), local_addr=(host, port))
    try:
        yield protocol, port
    finally:
        transport.close()
