"""Gossip between agents: SWIM + Lifeguard membership, the wire format and the keyring.

Knows nothing of projects or the replicated store (which will plug in behind a delegate). The
protocol logic (:mod:`agent.gossip.membership`) is pure: it runs on an injected scheduler and
transport, in virtual time on :mod:`agent.gossip.simnet` or on asyncio and UDP.
"""
