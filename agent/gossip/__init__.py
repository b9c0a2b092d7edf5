"""Gossip between agents: SWIM + Lifeguard membership, the wire format and the keyring.

Knows nothing of projects or the replicated store (which will plug in behind a delegate). The
protocol logic is pure: it runs on an injected scheduler and transport, in virtual time on the
in-memory network or on asyncio and UDP.

========================  ==================================================================
``config``                timings: one documented base, ``lan()`` and ``wan()`` presets
``messages``              wire format: versioned, bounded, validated; ``MessageError`` only
``membership``            the SWIM + Lifeguard state machine (probe, suspect, refute, gossip)
``suspicion``             one suspicion's timer, shortened by independent confirmations
``awareness``             local health score that stretches this node's own timeouts
``queue``                 transmit-limited broadcast queue, piggybacked on every packet
``scheduler``             timers: virtual time (tests, simulator) or the asyncio loop
``stats``                 counters for the metrics (probes, suspicions, messages, bytes, ...)
``keyring``               AES-GCM datagrams with key rotation (install, use, remove)
``transport``             encrypted UDP datagrams and TCP push-pull streams (asyncio)
``simnet``                in-memory network with loss, latency, kills and partitions
========================  ==================================================================
"""
