"""Every socket the configured agent (and its health sidecar, in the same pod network) will listen on,
and the pairs of them that can not both be bound.

Two listeners conflict when they share the protocol and the port (0, a free port, never conflicts)
and their addresses overlap: the same address, or a wildcard (``0.0.0.0``, ``::``) and any address
of its family. IPv6 sockets are v6-only here, so ``::`` does not overlap an IPv4 address. The
settings model refuses such a file (:class:`~region_agent.app.settings.AgentSettings`), so
``check-config`` says so and ``run`` never gets as far as a bind that fails.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from region_agent.health.settings import HealthMode

if TYPE_CHECKING:
    from region_agent.app.settings import AgentSettings

__all__ = ["Listener", "conflicts", "planned_listeners"]


@dataclass(frozen=True, slots=True)
class Listener:
    proto: str      # "tcp" or "udp"
    address: str    # an IP literal
    port: int
    setting: str    # the port setting that puts it there

    def overlaps(self, other: Listener) -> bool:
        if self.proto != other.proto or self.port != other.port or self.port == 0:
            return False
        mine, theirs = ipaddress.ip_address(self.address), ipaddress.ip_address(other.address)
        if mine.version != theirs.version:
            return False
        return mine == theirs or mine.is_unspecified or theirs.is_unspecified

    def __str__(self) -> str:
        return f"{self.setting} ({self.address} port {self.port}/{self.proto})"


def planned_listeners(settings: AgentSettings) -> list[Listener]:
    out: list[Listener] = []
    if settings.cluster.role != "witness":  # a witness serves no DNS
        out += _each(("udp", "tcp"), settings.dns.listen_addresses, settings.dns.port, "dns.port")
    h = settings.health
    out += _each(("tcp",), h.listen_addresses, h.port, "health.port")  # in the agent or in its sidecar
    out += _each(("tcp",), h.operator_listen_addresses, h.operator_port, "health.operator_port")
    if h.mode is HealthMode.SIDECAR:
        out += _each(("tcp",), h.operator_listen_addresses, h.sidecar_operator_port, "health.sidecar_operator_port")
    g = settings.gossip
    if g.enabled:
        out += _each(("udp", "tcp"), (g.bind_address,), g.port, "gossip.port")
    return out


def conflicts(listeners: list[Listener]) -> list[str]:
    """One line per pair of addresses that can not both bind (once, when both UDP and TCP collide)."""
    found: dict[tuple[str, str, str, str], str] = {}
    for i, first in enumerate(listeners):
        for second in listeners[i + 1:]:
            pair = (first.setting, first.address, second.setting, second.address)
            if pair not in found and first.overlaps(second):
                found[pair] = f"{first} and {second} can not both listen"
    return list(found.values())


def _each(protos: tuple[str, ...], addresses: tuple[str, ...], port: int, setting: str) -> list[Listener]:
    return [Listener(proto, address, port, setting) for address in addresses for proto in protos]
