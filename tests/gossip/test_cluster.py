"""Whole clusters on the in-memory network in virtual time: joins, failures, leaves, loss, partitions."""

from __future__ import annotations

from region_agent.gossip.config import lan
from region_agent.gossip.messages import State
from region_agent.gossip.simnet import SimCluster


def converged(cluster: SimCluster) -> bool:
    names = {m.local.name for m in cluster.alive()}
    for node in cluster.alive():
        seen = {v.member.name for v in node.members() if v.state is State.ALIVE}
        if not names <= seen:
            return False
    return True


def test_simultaneous_join_converges() -> None:
    cluster = SimCluster(lan(), seed=3)
    seed = cluster.add(0)
    joiners = [cluster.add(i) for i in range(1, 20)]
    for node in joiners:
        node.join([seed.local.addr])
    assert cluster.run_for(5.0, stop=lambda: converged(cluster))


def test_killed_member_is_declared_dead_by_all_and_nobody_else() -> None:
    cluster = SimCluster(lan(), seed=4)
    cluster.converged_start(10)
    cluster.run_for(5.0)
    victim = cluster.member(9).name
    cluster.kill(victim)
    assert cluster.run_for(30.0, stop=lambda: cluster.everyone_sees(victim, (State.DEAD,)))
    others = [m.local.name for m in cluster.alive()]
    assert all(cluster.everyone_sees(name, (State.ALIVE,)) for name in others)


def test_leave_is_left_not_dead() -> None:
    cluster = SimCluster(lan(), seed=5)
    cluster.converged_start(8)
    cluster.run_for(3.0)
    leaver = cluster.nodes[cluster.member(3).name]
    leaver.leave()
    cluster.run_for(1.0)
    leaver.stop()
    assert cluster.run_for(10.0, stop=lambda: cluster.everyone_sees(leaver.local.name, (State.LEFT,)))
    cluster.run_for(10.0)
    assert cluster.everyone_sees(leaver.local.name, (State.LEFT,))
    assert sum(m.stats.deaths for m in cluster.alive()) == 0


def test_no_false_failure_under_loss() -> None:
    cluster = SimCluster(lan(), seed=6, loss=0.05)
    cluster.converged_start(12)
    cluster.run_for(120.0)
    assert sum(m.stats.deaths for m in cluster.nodes.values()) == 0
    assert converged(cluster)


def test_broadcast_reaches_everyone() -> None:
    cluster = SimCluster(lan(), seed=7)
    nodes = cluster.converged_start(30)
    cluster.run_for(2.0)
    nodes[0].broadcast("change-1", b"store change")
    receivers = [cluster.events[n.local.name] for n in nodes[1:]]
    assert cluster.run_for(5.0, stop=lambda: all("change-1" in e.user for e in receivers))


def test_partitioned_member_is_declared_dead_then_rejoins_after_heal() -> None:
    cluster = SimCluster(lan(), seed=8)
    nodes = cluster.converged_start(8)
    cluster.run_for(3.0)
    lonely = nodes[7]
    cluster.network.partition([[lonely.local.addr]])
    assert cluster.run_for(30.0, stop=lambda: cluster.everyone_sees(lonely.local.name, (State.DEAD,)))
    cluster.run_for(lan().gossip_to_the_dead + 10.0)  # long enough for both sides to forget the other
    assert all(n.member(lonely.local.name) is None for n in nodes[:7])
    cluster.network.heal()
    # Neither side gossips to the other any more: the reconnect push-pulls bring them together.
    assert cluster.run_for(60.0, stop=lambda: converged(cluster))
    assert sum(m.stats.reconnects for m in nodes) > 0


def test_a_metadata_update_reaches_everyone_with_a_new_incarnation() -> None:
    cluster = SimCluster(lan(), seed=8)
    cluster.converged_start(10)
    cluster.run_for(2.0)
    node = cluster.nodes[cluster.member(4).name]
    before = node.local.incarnation
    assert node.update_meta({"dns-reachable": "no:tcp"})
    assert not node.update_meta({"dns-reachable": "no:tcp"})   # unchanged: nothing sent

    def everyone_knows() -> bool:
        views = [m.member(node.local.name) for m in cluster.alive()]
        return all(v is not None and v.member.metadata == {"dns-reachable": "no:tcp"} for v in views)

    assert cluster.run_for(5.0, stop=everyone_knows)
    assert node.local.incarnation == before + 1
    assert sum(m.stats.deaths for m in cluster.nodes.values()) == 0
