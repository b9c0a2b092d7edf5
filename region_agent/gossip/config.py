"""Membership timings: one base and the LAN/WAN presets derived from it.

N below is the number of members this node believes are not dead (itself included). Logarithms
are base 10 and ``log(N)`` is never taken below 1, as memberlist does, so small clusters keep a
sensible floor. The defaults follow memberlist's ``DefaultLANConfig``/``DefaultWANConfig`` with
deliberate changes, all measured in ``bench/gossip_sim.py``: probes run every 0.4 s instead of 1 s
and the suspicion multiplier is 3 instead of 4, so a killed agent is known dead by all in under
half Serf's time (for 5 probe packets per agent per second); Lifeguard (confirmations, local
health) keeps false failures at zero under 5 % loss. Joins run extra push-pulls, and failed
members are retried (Serf's reconnect), which memberlist alone does not do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GossipConfig:
    probe_interval: float = 0.4
    """Seconds between two probes of this node (one member each, round-robin over a shuffled list).
    Scaled by local health: ``interval * (awareness score + 1)``. Shorter detects failures sooner
    at the cost of 2 packets per interval per node."""

    probe_timeout: float = 0.2
    """Seconds to wait for a direct ack before asking ``indirect_checks`` members to probe. Should be
    above the 99th percentile RTT; scaled by local health like the interval."""

    indirect_checks: int = 3
    """k: members asked to probe a target that missed its direct ack (ping-req). More members mean
    fewer false suspicions from one bad path, at k*4 extra packets per failed probe."""

    suspicion_mult: int = 3
    """Minimum suspicion timeout: ``min = suspicion_mult * max(1, log10(N)) * probe_interval``. The
    timeout scales with the gossip propagation delay, which grows with log N. Also sets the
    confirmations Lifeguard expects: ``K = suspicion_mult - 2`` (0 when N - 2 < K)."""

    suspicion_max_timeout_mult: int = 6
    """Maximum suspicion timeout: ``max = suspicion_max_timeout_mult * min``. A suspicion starts at
    ``max`` and shrinks with C independent confirmations to
    ``max(min, max - (max - min) * log(C + 1) / log(K + 1))`` (Lifeguard)."""

    retransmit_mult: int = 4
    """A broadcast is sent ``retransmit_mult * ceil(log10(N + 1))`` times by each node that queues
    it, enough for an epidemic to reach every member with high probability."""

    gossip_interval: float = 0.2
    """Seconds between two gossip rounds (queued broadcasts to ``gossip_nodes`` random members). A
    round with nothing queued sends nothing."""

    gossip_nodes: int = 3
    """Fanout of one gossip round. Spread time is about ``log_{fanout}(N) * gossip_interval``."""

    gossip_to_the_dead: float = 30.0
    """Seconds a dead member still receives gossip (so it can learn it was declared dead and
    refute) and stays in the member list before it is forgotten."""

    push_pull_interval: float = 30.0
    """Seconds between full state exchanges with one random member over a stream. Scaled up for
    big clusters: ``interval * (ceil(log2(N) - log2(32)) + 1)`` when N > 32, so the total sync
    bandwidth stays bounded. Repairs anything a lost broadcast missed."""

    reconnect_interval: float = 10.0
    """Seconds between two push-pulls with a random member this node believes failed (not left),
    as Serf's reconnect does: after a partition heals the two sides find each other again even
    when each declared the other dead and forgot it. Scaled like the push-pull interval, since
    each one carries the whole member list."""

    reconnect_timeout: float = 24 * 3600.0
    """Seconds a failed member is still tried by reconnect (Serf's default), at most
    ``reconnect_limit`` of them."""

    reconnect_limit: int = 1024

    join_sync_delays: tuple[float, ...] = (0.5, 1.5)
    """Seconds after a join at which a node runs an extra push-pull with a random member, so many
    agents joining at once learn of each other in seconds instead of at the next periodic sync."""

    awareness_max_multiplier: int = 8
    """Local health (Lifeguard): the score ranges over ``0 .. multiplier - 1`` and probe interval
    and timeout are multiplied by ``score + 1``. A node that misses acks and nacks itself (CPU
    starvation, a bad link) slows its own probing instead of accusing healthy members."""

    packet_bytes: int = 1400
    """Largest datagram, encryption overhead included: below the path MTU of the internet."""

    stream_bytes: int = 8 * 1024 * 1024
    """Largest push-pull message over a stream."""

    user_seen_keys: int = 4096
    """Broadcast keys remembered to drop duplicates of a user broadcast (bounded memory)."""

    broadcast_queue_max: int = 4096
    """Broadcasts queued at most; past it the most-sent are dropped (anti-entropy repairs them)."""

    def __post_init__(self) -> None:
        positive = ("probe_interval", "probe_timeout", "gossip_interval", "gossip_to_the_dead",
                    "push_pull_interval", "reconnect_interval", "reconnect_timeout")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.probe_interval < 2 * self.probe_timeout:
            # What is left of the interval after the direct timeout is the indirect probes' time:
            # four one-way hops and the helpers' own timeout for the nack.
            raise ValueError("probe_interval must be at least twice probe_timeout")
        for name in ("indirect_checks", "gossip_nodes", "retransmit_mult", "suspicion_mult",
                     "suspicion_max_timeout_mult", "awareness_max_multiplier", "reconnect_limit",
                     "broadcast_queue_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.packet_bytes < 512 or self.stream_bytes < self.packet_bytes:
            raise ValueError("packet_bytes must be >= 512 and stream_bytes >= packet_bytes")

    # Formulas, in one place so the docs above and the code cannot drift apart.

    def suspicion_min(self, members: int) -> float:
        return self.suspicion_mult * max(1.0, math.log10(max(1, members))) * self.probe_interval

    def suspicion_max(self, members: int) -> float:
        return self.suspicion_max_timeout_mult * self.suspicion_min(members)

    def expected_confirmations(self, members: int) -> int:
        k = self.suspicion_mult - 2
        return 0 if members - 2 < k else k

    def retransmit_limit(self, members: int) -> int:
        return self.retransmit_mult * math.ceil(math.log10(members + 1))

    def sync_scale(self, members: int) -> int:
        """How much rarer full syncs get in big clusters: ``ceil(log2(N) - log2(32)) + 1`` above 32."""
        return 1 if members <= 32 else math.ceil(math.log2(members) - math.log2(32)) + 1

    def push_pull_every(self, members: int) -> float:
        return self.push_pull_interval * self.sync_scale(members)

    def reconnect_every(self, members: int) -> float:
        return self.reconnect_interval * self.sync_scale(members)


def suspicion_timeout(minimum: float, maximum: float, confirmations: int, expected: int) -> float:
    """Lifeguard: ``max(min, max - (max - min) * log(C + 1) / log(K + 1))``; ``min`` once C >= K."""
    if expected < 1:
        return minimum
    fraction = math.log(confirmations + 1) / math.log(expected + 1)
    return max(minimum, maximum - (maximum - minimum) * fraction)


def base() -> GossipConfig:
    return GossipConfig()


def lan() -> GossipConfig:
    """Agents of one region: sub-millisecond RTTs, the base as it is."""
    return base()


def wan() -> GossipConfig:
    """Agents across regions (internet RTTs up to ~300 ms): slower probes with room for the RTT,
    longer suspicion (more loss), gossip to one more member less often, rarer full syncs; the
    direction of memberlist's DefaultWANConfig, scaled to our base and checked in the simulator
    at 20-150 ms one-way latency and 5 % loss."""
    b = base()
    return dataclasses.replace(
        b,
        probe_interval=b.probe_interval * 5,        # 2 s: WAN probes are costlier and RTTs longer
        probe_timeout=0.8,                          # > twice the worst internet RTT; leaves 1.2 s
                                                    # for the four hops of an indirect probe
        suspicion_mult=b.suspicion_mult + 1,        # 4: more loss, more time to refute
        gossip_interval=b.gossip_interval * 2.5,    # 0.5 s
        gossip_nodes=b.gossip_nodes + 1,            # 4: fewer rounds, more members each
        push_pull_interval=b.push_pull_interval * 2,  # 60 s
        reconnect_interval=b.reconnect_interval * 3,  # 30 s, Serf's default
        join_sync_delays=(2.0, 5.0),
    )
