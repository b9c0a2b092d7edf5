"""The write gate: whether this agent takes control-API writes now.

An agent alone (no gossip) always does. In a cluster it takes them only while it sees a strict
majority of the known regions alive (:func:`~region_agent.cluster.quorum.has_majority`) *and*
has heard from a majority within two probe intervals (an ack of our probe or of the contact ping
the membership sends one member of every other region each interval, or their ping:
:func:`~region_agent.cluster.quorum.has_contact_majority`). SWIM takes a suspicion timeout per
member to declare the others dead; the contact rule closes the gate within two probe intervals
of being cut off, so a minority does not acknowledge writes that a majority never sees.

The window is not stretched by local health: an agent that can not reach the others is exactly
the one whose health score drops.
"""

from __future__ import annotations

from collections.abc import Callable

from region_agent.cluster.quorum import ClusterView, has_contact_majority, has_majority
from region_agent.gossip.membership import Membership


class WriteGate:
    def __init__(self, view: Callable[[], ClusterView], membership: Membership, now: Callable[[], float]) -> None:
        """``now``: the membership scheduler's clock (the one ``last_ack`` is kept in)."""
        self._view = view
        self._membership = membership
        self._now = now

    def window(self) -> float:
        """Two contact pings: the membership pings one member of every other region each probe interval,
        so the window does not grow with the number of members (it did: two SWIM rounds of N members)."""
        c = self._membership.config
        return 2 * (c.probe_interval + c.probe_timeout)

    def open(self) -> bool:
        view = self._view()
        return has_majority(view) and has_contact_majority(view, self._membership.last_ack, self._now(),
                                                            self.window())
