"""Gossip between agents: SWIM + Lifeguard membership, the wire format and the keyring.

Knows nothing of projects or the replicated store, which plugs in behind ``sync.Replica``
(``region_agent.app.replication``). The protocol logic is pure: it runs on an injected scheduler and
transport, in virtual time on the in-memory network or on asyncio and UDP.

========================  ==================================================================
``config``                timings: one documented base, ``lan()`` and ``wan()`` presets
``settings``              the agent's ``gossip`` settings group (bind, seeds, keys, presets)
``messages``              wire format: versioned, bounded, validated; ``MessageError`` only
``membership``            the SWIM + Lifeguard state machine (probe, suspect, refute, gossip)
``suspicion``             one suspicion's timer, shortened by independent confirmations
``awareness``             local health score that stretches this node's own timeouts
``queue``                 transmit-limited broadcast queue, piggybacked on every packet
``scheduler``             timers: virtual time (tests, simulator) or the asyncio loop
``stats``                 counters for the metrics (probes, suspicions, messages, bytes, ...)
``metrics``               the Prometheus collector reading those counters at scrape time
``sync``                  anti-entropy: digest push-pull over streams, opaque entries (``Replica``)
``keyring``               AES-GCM datagrams with key rotation (install, use, remove)
``keyfile``               the keyring file and its watcher (rotation without a restart)
``tls``                   mutual TLS for streams under the cluster CA
``transport``             encrypted UDP datagrams and TCP streams (asyncio)
``node``                  one agent's gossip: transport, membership and anti-entropy wired
``simnet``                in-memory network with loss, latency, kills and partitions
========================  ==================================================================
"""
