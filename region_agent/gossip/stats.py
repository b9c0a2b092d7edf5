"""Counters of the membership protocol, kept as plain numbers; the Prometheus wiring reads them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GossipStats:
    probes: int = 0                 # probes this node started
    probe_failures: int = 0         # probes that got no ack, direct or indirect
    indirect_probes: int = 0        # ping-reqs this node sent
    suspicions: int = 0             # alive -> suspect transitions here (own probes and gossip alike)
    refutations: int = 0            # times this node refuted a suspicion or death of itself
    deaths: int = 0                 # members this node declared dead (its own timer)
    push_pulls: int = 0             # push-pull exchanges this node started (periodic and after a join)
    reconnects: int = 0             # push-pulls sent to a member believed failed
    sent_messages: Counter[str] = field(default_factory=Counter)
    sent_bytes: Counter[str] = field(default_factory=Counter)
    received_messages: Counter[str] = field(default_factory=Counter)
    received_bytes: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)   # by reason: malformed, key, too_large, ...

    def sent(self, kind: str, size: int) -> None:
        self.sent_messages[kind] += 1
        self.sent_bytes[kind] += size

    def received(self, kind: str, size: int) -> None:
        self.received_messages[kind] += 1
        self.received_bytes[kind] += size
