"""The members as the control API and the CLI show them: plain rows, with wall times and round trips.

Gossip's :class:`~region_agent.gossip.membership.MemberView` holds scheduler time and protocol
types; a :class:`MemberRow` is what a person reads (``region-agent members``, ``/v1/members``),
so the control API needs nothing from gossip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from region_agent.gossip.membership import MemberView
from region_agent.gossip.messages import State

LIVE_STATES = (State.ALIVE, State.SUSPECT)


@dataclass(frozen=True, slots=True)
class MemberRow:
    name: str
    region: str
    node: str
    role: str              # agent | witness
    state: str             # alive | suspect | dead | left
    since: float           # wall time of the last state change
    address: str
    incarnation: int
    meta: Mapping[str, str]
    rtt: float | None      # seconds of this agent's last acked probe of it, None: not measured

    @property
    def live(self) -> bool:
        return self.state in ("alive", "suspect")


def member_rows(views: Iterable[MemberView], *, since_wall: Callable[[MemberView], float],
                rtt: Callable[[str], float | None]) -> list[MemberRow]:
    """Rows of ``views``, sorted by name; ``since_wall`` turns a view's scheduler time into wall time."""
    return [MemberRow(name=v.member.name, region=v.member.region, node=v.member.node, role=v.member.role.value,
                      state=v.state.name.lower(), since=since_wall(v), address=str(v.member.addr),
                      incarnation=v.member.incarnation, meta=v.member.metadata, rtt=rtt(v.member.name))
            for v in sorted(views, key=lambda v: v.member.name)]
