"""The write gate's bound at 3, 15 and 60 members, in virtual time (issue 20 item 5).

Real memberships exchange real messages on the simulated network (:mod:`region_agent.gossip.simnet`);
the gate of one agent is sampled every 50 ms of simulated time: open all along in a healthy cluster,
then its region is cut from the other two, and the gate must close within its window (two probe
intervals after the last contact, which came before the cut) and stay closed while the cut lasts.
Before the contact ping (a suspicion counted as contact, two SWIM rounds of N members) the close time
grew with N: 82 s at 15 members and 806 s at 60 on ``wan``.
"""

from __future__ import annotations

import pytest

from region_agent.cluster.quorum import Quorum
from region_agent.cluster.write_gate import WriteGate
from region_agent.gossip.config import GossipConfig, lan, wan
from region_agent.gossip.simnet import SimCluster

REGIONS = ("sfo1", "fra1", "sgp1")
STEP = 0.05


def _gate(cluster: SimCluster, name: str) -> WriteGate:
    node = cluster.nodes[name]
    quorum = Quorum(local_region=node.local.region, max_age=60.0, clock=cluster.scheduler.now)
    return WriteGate(lambda: quorum.view(regions=REGIONS, members=node.members()), node, cluster.scheduler.now)


def _close_time(config: GossipConfig, n: int, hold: float) -> tuple[float, float, bool]:
    """(seconds from the cut until the gate closed, its window, whether it re-opened during ``hold``)."""
    cluster = SimCluster(config, seed=n, regions=REGIONS)
    nodes = cluster.converged_start(n)
    cluster.run_for(10 * config.probe_interval)    # steady state: every contact timer armed
    isolated = nodes[0]
    gate = _gate(cluster, isolated.local.name)
    start = cluster.scheduler.now()
    while cluster.scheduler.now() - start < hold:   # whole: open all along (contact keeps up with N)
        cluster.run_for(STEP)
        assert gate.open(), f"the gate closed {cluster.scheduler.now() - start:.2f} s into a healthy run"
    cut = [m.local.addr for m in nodes if m.local.region == isolated.local.region]
    cluster.network.partition([cut])
    start = cluster.scheduler.now()
    closed_at: float | None = None
    reopened = False
    while cluster.scheduler.now() - start < hold:
        cluster.run_for(STEP)
        if gate.open():
            reopened = reopened or closed_at is not None
        elif closed_at is None:
            closed_at = cluster.scheduler.now() - start
    assert closed_at is not None, f"the gate never closed in {hold} s"
    return closed_at, gate.window(), reopened


@pytest.mark.parametrize("preset", ["lan", "wan"])
@pytest.mark.parametrize("n", [3, 15, 60])
def test_the_gate_closes_within_two_probe_intervals_whatever_the_number_of_members(preset: str, n: int) -> None:
    config = lan() if preset == "lan" else wan()
    hold = 30 * config.probe_interval              # longer than any suspicion timeout at these sizes
    closed_at, window, reopened = _close_time(config, n, hold)
    bound = window + 2 * STEP                      # the last contact came at most at the cut
    assert closed_at <= bound, f"{preset} n={n}: closed after {closed_at} s (bound {bound} s)"
    assert not reopened, f"{preset} n={n}: the gate re-opened during the partition"
