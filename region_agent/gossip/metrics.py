"""Prometheus view of gossip, read from the plain counters at scrape time (nothing on the hot path)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from region_agent.gossip.messages import State

if TYPE_CHECKING:
    from region_agent.gossip.keyfile import KeyringWatcher
    from region_agent.gossip.node import GossipNode
    from region_agent.gossip.transport import StreamCounters

_COUNTERS = (
    ("probes", "Probes this agent started"),
    ("probe_failures", "Probes that got no ack, direct or indirect"),
    ("indirect_probes", "Indirect probes (ping-req) this agent sent"),
    ("suspicions", "Members this agent saw become suspect"),
    ("refutations", "Suspicions of itself this agent refuted"),
    ("deaths", "Members this agent declared dead"),
    ("push_pulls", "Member-list push-pulls this agent started"),
    ("reconnects", "Push-pulls sent to members believed failed"),
)


class GossipCollector(Collector):
    def __init__(self, node: GossipNode, regions: Callable[[], Iterable[str]] = tuple) -> None:
        """``regions``: the configured regions, each exported in region_members even with no member left (a
        region whose agents all died reads 0, where an alert can see it, instead of vanishing)."""
        self._node = node
        self._regions = regions

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        node = self._node
        stats = node.stats
        members = GaugeMetricFamily("region_agent_gossip_members", "Members known, by state", labels=["state"])
        counts = {state.name.lower(): 0 for state in State}
        regions: dict[str, int] = dict.fromkeys(self._regions(), 0)
        for view in node.members():
            counts[view.state.name.lower()] += 1
            if view.state in (State.ALIVE, State.SUSPECT):
                regions[view.member.region] = regions.get(view.member.region, 0) + 1
        for state, count in counts.items():
            members.add_metric([state], count)
        yield members
        by_region = GaugeMetricFamily("region_agent_gossip_region_members",
                                      "Members alive or suspect, by region", labels=["region"])
        for region, count in sorted(regions.items()):
            by_region.add_metric([region], count)
        yield by_region
        for name, help_text in _COUNTERS:
            yield CounterMetricFamily(f"region_agent_gossip_{name}", help_text, value=getattr(stats, name))
        messages = CounterMetricFamily("region_agent_gossip_messages", "Gossip messages by direction and type",
                                       labels=["direction", "type"])
        size = CounterMetricFamily("region_agent_gossip_bytes", "Gossip bytes by direction and type",
                                   labels=["direction", "type"])
        for direction, counts_, bytes_ in (("sent", stats.sent_messages, stats.sent_bytes),
                                           ("received", stats.received_messages, stats.received_bytes)):
            for kind in sorted(counts_):
                messages.add_metric([direction, kind], counts_[kind])
                size.add_metric([direction, kind], bytes_[kind])
        yield messages
        yield size
        rejected = CounterMetricFamily("region_agent_gossip_rejected",
                                       "Datagrams, streams and messages refused, by reason", labels=["reason"])
        for reason in sorted(stats.rejected):
            rejected.add_metric([reason], stats.rejected[reason])
        yield rejected
        yield from _stream_families(None if node.transport is None else node.transport.streams.counters)
        membership = node.membership
        yield GaugeMetricFamily("region_agent_gossip_health_score",
                                "Local health (Lifeguard): 0 is healthy; higher stretches this agent's timeouts",
                                value=0 if membership is None else membership.health_score)
        yield GaugeMetricFamily("region_agent_gossip_queued_broadcasts", "Broadcasts waiting to be gossiped",
                                value=0 if membership is None else membership.queued_broadcasts())
        yield CounterMetricFamily("region_agent_gossip_broadcasts_dropped",
                                  "Broadcasts dropped from a full queue (anti-entropy repairs what they carried)",
                                  value=0 if membership is None else membership.dropped_broadcasts())
        sync = node.anti_entropy
        rounds = CounterMetricFamily("region_agent_gossip_sync_rounds",
                                     "Anti-entropy rounds by result (in_sync, repaired, exchanged, timeout, busy, "
                                     "unknown, error)", labels=["result"])
        entries = CounterMetricFamily("region_agent_gossip_sync_entries", "Store entries moved by anti-entropy",
                                      labels=["direction"])
        in_sync = GaugeMetricFamily("region_agent_gossip_peers_in_sync",
                                    "Peers whose store digest, as last heard, equals this agent's")
        if sync is not None:
            for result in sorted(sync.stats.rounds):
                rounds.add_metric([result], sync.stats.rounds[result])
            entries.add_metric(["sent"], sync.stats.entries_sent)
            entries.add_metric(["received"], sync.stats.entries_received)
            entries.add_metric(["applied"], sync.stats.entries_applied)
            entries.add_metric(["dropped"], sync.stats.entries_dropped)
            mine = node.replica.digest().hex()
            in_sync.add_metric([], sum(1 for d in sync.peer_digests.values() if d.digest == mine))
        yield rounds
        yield entries
        yield in_sync
        yield GaugeMetricFamily("region_agent_gossip_pull_only", "1 while this agent rejoins pull-only after an "
                                "absence beyond the tombstone horizon (not ready, no answers, no writes)",
                                value=1 if sync is not None and sync.pull_only else 0)
        yield GaugeMetricFamily("region_agent_gossip_join_attempts", "Joins of the seeds tried while alone",
                                value=node.join_attempts)


def _stream_families(counters: StreamCounters | None) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The stream listener's bounds at work: refusals and closes by reason, what it holds now; and the bounds
    of this agent's own streams: sends dropped by reason, what they hold now."""
    refused = CounterMetricFamily("region_agent_gossip_stream_refused",
                                  "Gossip TCP connections or frames refused by the listener's bounds, by reason",
                                  labels=["reason"])
    closed = CounterMetricFamily("region_agent_gossip_stream_closed",
                                 "Gossip TCP connections the listener closed before their frame was whole, by reason",
                                 labels=["reason"])
    send_dropped = CounterMetricFamily("region_agent_gossip_stream_send_dropped",
                                       "This agent's gossip TCP messages dropped unsent by its bounds, by reason",
                                       labels=["reason"])
    if counters is not None:
        for reason in sorted(counters.refused):
            refused.add_metric([reason], counters.refused[reason])
        for reason in sorted(counters.closed):
            closed.add_metric([reason], counters.closed[reason])
        for reason in sorted(counters.send_dropped):
            send_dropped.add_metric([reason], counters.send_dropped[reason])
    yield refused
    yield closed
    yield send_dropped
    yield GaugeMetricFamily("region_agent_gossip_stream_send_pending",
                            "This agent's gossip TCP messages waiting for a turn or in flight now",
                            value=0 if counters is None else counters.send_pending)
    yield GaugeMetricFamily("region_agent_gossip_stream_send_waiting",
                            "This agent's gossip TCP messages waiting for a turn now (part of send_pending)",
                            value=0 if counters is None else counters.send_waiting)
    yield GaugeMetricFamily("region_agent_gossip_stream_send_pending_bytes",
                            "Sealed bytes of this agent's gossip TCP messages waiting or in flight now",
                            value=0 if counters is None else counters.send_pending_bytes)
    yield GaugeMetricFamily("region_agent_gossip_streams_open", "Incoming gossip TCP connections open now",
                            value=0 if counters is None else counters.open)
    yield GaugeMetricFamily("region_agent_gossip_stream_buffered_bytes",
                            "Bytes reserved now for incoming gossip frames being read",
                            value=0 if counters is None else counters.buffered)


class KeyringCollector(Collector):
    """The live keyring as its watcher keeps it: how many keys are accepted, and file changes applied."""

    def __init__(self, watcher: KeyringWatcher) -> None:
        self._watcher = watcher

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield GaugeMetricFamily("region_agent_gossip_keyring_keys", "Gossip keys accepted (the primary included)",
                                value=len(self._watcher.keyring.keys()))
        yield CounterMetricFamily("region_agent_gossip_keyring_reloads",
                                  "Keyring file changes applied to the live keyring", value=self._watcher.reloads)


def register(node: GossipNode, registry: CollectorRegistry, watcher: KeyringWatcher | None = None,
             regions: Callable[[], Iterable[str]] = tuple) -> None:
    registry.register(GossipCollector(node, regions))
    if watcher is not None:
        registry.register(KeyringCollector(watcher))
