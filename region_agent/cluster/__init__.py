"""Decisions the regions take together: liveness and ingress by quorum, the write gate."""
