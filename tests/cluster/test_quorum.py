"""Table tests of the quorum rules (region_agent.cluster.quorum) with a controllable clock."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from region_agent.base.clock import ManualClock
from region_agent.cluster.quorum import (
    Aspect,
    ClusterView,
    Observation,
    Policy,
    Quorum,
    Status,
    alive_regions,
    has_contact_majority,
    has_majority,
    known_regions,
    latest_observations,
    liveness_observations,
    region_verdict,
    regions_in_answers,
    verdicts,
    witness_regions,
)
from region_agent.gossip.membership import MemberView
from region_agent.gossip.messages import Address, Member, Role, State

NOW = 1_800_000_000.0
MAX_AGE = 30.0
A, B, C, W = "sfo1", "ams1", "nrt1", "wit1"
L, IN = Aspect.LIVENESS, Aspect.INGRESS


def _member(region: str, n: int, state: State, role: Role = Role.AGENT) -> MemberView:
    node = f"node{n}"
    return MemberView(Member(f"{region}-{node}", region, node, role, Address(f"127.0.0.{n + 1}", 7946)), state, 0.0)


@dataclass
class Case:
    """One agent's view: the regions, the state of each region's agents as it sees them, observations."""

    local: str
    regions: tuple[str, ...]
    states: dict[str, tuple[State, ...]]  # region -> state of each of its agents (default: one ALIVE agent)
    witness: dict[str, State] = field(default_factory=dict)  # witness region -> its one member's state
    obs: tuple[tuple[Aspect, str, str, bool, float], ...] = ()  # (aspect, observer, subject, up, age in s)
    fenced: tuple[str, ...] = ()

    def view(self) -> ClusterView:
        members = [_member(r, i, s) for r in self.regions for i, s in enumerate(self.states.get(r, (State.ALIVE,)))]
        members += [_member(r, 9, s, Role.WITNESS) for r, s in self.witness.items()]
        observations = [Observation(aspect, observer, subject, up, NOW - age)
                        for aspect, observer, subject, up, age in self.obs]
        return Quorum(local_region=self.local, max_age=MAX_AGE, clock=lambda: NOW).view(
            regions=self.regions, members=members, fenced=self.fenced, observations=observations,
            witnesses=self.witness.keys())


THREE = (A, B, C)
TWO = (A, B)
DEAD = (State.DEAD,)

# name, case, region judged, expected status, in answers under hold, under failover
VERDICTS = [
    ("all alive", Case(A, THREE, {}), B, Status.UP, True, True),
    ("suspect counts as alive", Case(A, THREE, {B: (State.SUSPECT,)}), B, Status.UP, True, True),
    ("one agent of two alive keeps the region", Case(A, THREE, {B: (State.DEAD, State.ALIVE)}), B, Status.UP,
     True, True),
    # three regions, link A-B cut: A's membership and A's probes say B is gone, C disagrees.
    ("cut link, from A: silent B kept",
     Case(A, THREE, {B: DEAD}, obs=((L, C, B, True, 1), (IN, A, B, False, 1), (IN, C, B, True, 1))), B, Status.UP,
     True, True),
    ("cut link, from A: ingress of B kept", Case(A, THREE, {}, obs=((IN, A, B, False, 1), (IN, C, B, True, 1))), B,
     Status.UP, True, True),
    ("cut link, from C: B kept", Case(C, THREE, {}, obs=((IN, A, B, False, 1), (IN, C, B, True, 1))), B, Status.UP,
     True, True),
    ("cut link, from B: A kept", Case(B, THREE, {A: DEAD}, obs=((L, C, A, True, 1), (IN, B, A, False, 1),
                                                                 (IN, C, A, True, 1))), A, Status.UP, True, True),
    # A isolated from both others.
    ("isolated A, from B: out", Case(B, THREE, {A: DEAD}, obs=((L, C, A, False, 1),)), A, Status.OUT, False, False),
    ("isolated A, from C: out", Case(C, THREE, {A: DEAD}, obs=((L, B, A, False, 2),)), A, Status.OUT, False, False),
    ("isolated A, from A: B held", Case(A, THREE, {B: DEAD, C: DEAD}), B, Status.HELD, True, True),
    ("isolated A, from A: C held", Case(A, THREE, {B: DEAD, C: DEAD}), C, Status.HELD, True, True),
    ("isolated A, from B, C's vote stale: kept", Case(B, THREE, {A: DEAD}, obs=((L, C, A, False, MAX_AGE + 1),)),
     A, Status.UP, True, True),
    ("isolated A, from B, C's vote missing: kept", Case(B, THREE, {A: DEAD}), A, Status.UP, True, True),
    ("isolated A, from B, C sees A alive: kept", Case(B, THREE, {A: DEAD}, obs=((L, C, A, True, 1),)), A,
     Status.UP, True, True),
    ("latest vote of a region counts", Case(B, THREE, {A: DEAD}, obs=((L, C, A, True, 20), (L, C, A, False, 2))),
     A, Status.OUT, False, False),
    ("a dead region's vote does not count", Case(B, (A, B, C, "iad1", "lhr1"), {A: DEAD, "lhr1": DEAD},
                                                  obs=((L, "lhr1", A, False, 1),)), A, Status.UP, True, True),
    ("five regions, three agree", Case(B, (A, B, C, "iad1", "lhr1"), {A: DEAD},
                                       obs=((L, C, A, False, 1), (L, "iad1", A, False, 1))), A, Status.OUT, False,
     False),
    # ingress by quorum (every region alive)
    ("ingress down seen by both others", Case(A, THREE, {}, obs=((IN, A, B, False, 1), (IN, C, B, False, 1))), B,
     Status.OUT, False, False),
    ("own ingress down seen by both others", Case(A, THREE, {}, obs=((IN, B, A, False, 1), (IN, C, A, False, 1))), A,
     Status.OUT, False, False),
    ("ingress down seen by one of two", Case(C, THREE, {}, obs=((IN, A, B, False, 1),)), B, Status.UP, True, True),
    ("stale ingress verdicts do not count", Case(A, THREE, {}, obs=((IN, A, B, False, 31), (IN, C, B, False, 40))),
     B, Status.UP, True, True),
    ("a region's own ingress verdict about itself does not count",
     Case(A, THREE, {}, obs=((IN, B, B, False, 1), (IN, C, B, False, 1))), B, Status.UP, True, True),
    ("latest ingress verdict wins", Case(A, THREE, {}, obs=((IN, A, B, False, 1), (IN, C, B, False, 9),
                                                             (IN, C, B, True, 3))), B, Status.UP, True, True),
    # one live vantage point besides the judged region (the third region silent): one vote is no quorum
    ("third region dead, B's ingress down seen by A alone",
     Case(A, THREE, {C: DEAD}, obs=((IN, A, B, False, 1),)), B, Status.CONTESTED, True, False),
    ("being cut off, from C: A dead, B suspect, B's ingress down seen by C alone",
     Case(C, THREE, {A: DEAD, B: (State.SUSPECT,)}, obs=((IN, C, B, False, 1),)), B, Status.CONTESTED, True, False),
    ("third region dead: its silence still out by the other two",
     Case(A, THREE, {C: DEAD}, obs=((L, B, C, False, 1),)), C, Status.OUT, False, False),
    # fencing
    ("fenced is out", Case(A, THREE, {}, fenced=(B,)), B, Status.FENCED, False, False),
    ("fenced in a minority is still out", Case(A, THREE, {B: DEAD, C: DEAD}, fenced=(B,)), B, Status.FENCED, False,
     False),
    # two regions, no witness: no majority can exist, the policy decides
    ("two regions, B silent", Case(A, TWO, {B: DEAD}), B, Status.CONTESTED, True, False),
    ("two regions, B's ingress down", Case(A, TWO, {}, obs=((IN, A, B, False, 1),)), B, Status.CONTESTED, True, False),
    ("two regions, all well", Case(A, TWO, {}), B, Status.UP, True, True),
    ("two regions, stale ingress verdict", Case(A, TWO, {}, obs=((IN, A, B, False, 60),)), B, Status.UP, True, True),
    # two regions and a witness
    ("witness agrees B is silent", Case(A, TWO, {B: DEAD}, {W: State.ALIVE}, obs=((L, W, B, False, 1),)), B,
     Status.OUT, False, False),
    ("witness still sees B (A-B link cut)", Case(A, TWO, {B: DEAD}, {W: State.ALIVE}, obs=((L, W, B, True, 1),)),
     B, Status.UP, True, True),
    ("witness sees B's ingress down too", Case(A, TWO, {}, {W: State.ALIVE}, obs=((IN, A, B, False, 1),
                                                                                   (IN, W, B, False, 1))), B,
     Status.OUT, False, False),
    ("witness sees B's ingress up", Case(A, TWO, {}, {W: State.ALIVE}, obs=((IN, A, B, False, 1), (IN, W, B, True, 1))),
     B, Status.UP, True, True),
    ("A isolated from B and witness", Case(A, TWO, {B: DEAD}, {W: State.DEAD}), B, Status.HELD, True, True),
    # A registered witness that left still counts (a dead vantage point): A alone is a minority and drops
    # nobody, so two regions under failover never both drop each other.
    ("witness left: still a vantage point", Case(A, TWO, {B: DEAD}, {W: State.LEFT}), B, Status.HELD, True, True),
]


@pytest.mark.parametrize(("case", "region", "status", "hold", "failover"), [v[1:] for v in VERDICTS],
                         ids=[v[0] for v in VERDICTS])
def test_verdicts(case: Case, region: str, status: Status, hold: bool, failover: bool) -> None:
    verdict = region_verdict(case.view(), region)
    assert verdict.status is status, verdict.reason
    assert verdict.in_answers(Policy.HOLD) is hold
    assert verdict.in_answers(Policy.FAILOVER) is failover


# name, case, majority
MAJORITY = [
    ("three alive", Case(A, THREE, {}), True),
    ("two of three", Case(A, THREE, {C: DEAD}), True),
    ("one of three", Case(A, THREE, {B: DEAD, C: DEAD}), False),
    ("suspects count", Case(A, THREE, {B: (State.SUSPECT,), C: DEAD}), True),
    ("two of two", Case(A, TWO, {}), True),
    ("one of two", Case(A, TWO, {B: DEAD}), False),
    ("one of two, witness alive", Case(A, TWO, {B: DEAD}, {W: State.ALIVE}), True),
    ("one of two, witness dead", Case(A, TWO, {B: DEAD}, {W: State.DEAD}), False),
    ("one of two, witness suspect", Case(A, TWO, {B: DEAD}, {W: State.SUSPECT}), True),
    ("two of four", Case(A, ("sfo1", "ams1", "nrt1", "iad1"), {C: DEAD, "iad1": DEAD}), False),
    ("single region", Case(A, (A,), {}), True),
    ("a departed region is not known", Case(A, THREE, {C: (State.LEFT,), B: DEAD}), False),
]


@pytest.mark.parametrize(("case", "majority"), [m[1:] for m in MAJORITY], ids=[m[0] for m in MAJORITY])
def test_has_majority(case: Case, majority: bool) -> None:
    assert has_majority(case.view()) is majority


def test_only_configured_regions_and_registered_witnesses_vote() -> None:
    view = Case(A, TWO, {B: (State.LEFT,)}, {W: State.ALIVE}).view()
    assert known_regions(view) == {A, B, W}  # B is configured; the witness is registered
    assert alive_regions(view) == {A, W}
    assert witness_regions(view) == {W}
    gone = Case(A, (A,), {}, {W: State.LEFT}).view()
    assert known_regions(gone) == {A, W} and alive_regions(gone) == {A}   # a forgotten witness still counts
    # Members of a region nobody configured (forged or stray): no vote, no majority for them.
    stray = Quorum(local_region=A, max_age=MAX_AGE, clock=lambda: NOW).view(
        regions=THREE, members=[_member(A, 0, State.ALIVE), _member("xxx1", 1, State.ALIVE),
                                _member("xxx2", 2, State.ALIVE), _member("xxx3", 3, State.ALIVE)])
    assert known_regions(stray) == set(THREE) and alive_regions(stray) == {A}
    assert not has_majority(stray)


def test_liveness_observations_are_what_this_region_gossips() -> None:
    view = Case(A, THREE, {C: DEAD}, {W: State.ALIVE}).view()
    assert liveness_observations(view) == [
        Observation(L, A, B, True, NOW), Observation(L, A, C, False, NOW), Observation(L, A, W, True, NOW)]


def test_the_clock_decides_freshness() -> None:
    clock = ManualClock(now_wall=NOW)
    quorum = Quorum(local_region=B, max_age=MAX_AGE, clock=clock.wall)
    members = [_member(A, 0, State.DEAD), _member(B, 0, State.ALIVE), _member(C, 0, State.ALIVE)]
    vote = Observation(L, C, A, False, NOW)

    def status() -> Status:
        return region_verdict(quorum.view(regions=THREE, members=members, observations=[vote]), A).status

    assert status() is Status.OUT
    clock.advance(MAX_AGE)
    assert status() is Status.OUT  # exactly max_age old still counts
    clock.advance(0.001)
    assert status() is Status.UP
    assert latest_observations(quorum.view(regions=THREE, members=members, observations=[vote]), L) == {}
    with pytest.raises(ValueError):
        Quorum(local_region=A, max_age=0, clock=lambda: NOW)


def test_whole_cluster_under_each_policy() -> None:
    isolated_from_b = Case(B, THREE, {A: DEAD}, obs=((L, C, A, False, 1),)).view()
    assert regions_in_answers(isolated_from_b) == {B, C}
    assert set(verdicts(isolated_from_b)) == set(THREE)
    pair = Case(A, TWO, {B: DEAD}).view()
    assert regions_in_answers(pair, Policy.HOLD) == {A, B}
    assert regions_in_answers(pair, Policy.FAILOVER) == {A}
    isolated_self = Case(A, THREE, {B: DEAD, C: DEAD}).view()
    assert regions_in_answers(isolated_self, Policy.FAILOVER) == set(THREE)  # a minority removes nobody


@pytest.mark.parametrize(("heard", "expected"), [
    ({f"{B}-node0": 99.0, f"{C}-node0": 99.0}, True),    # both heard a second ago
    ({f"{B}-node0": 99.0, f"{C}-node0": 50.0}, True),    # one other region recently: 2 of 3
    ({f"{B}-node0": 50.0, f"{C}-node0": 50.0}, False),   # just cut off: both still "alive", neither heard
    ({}, False),                                          # never acked, alive since t=0: too long ago
])
def test_the_write_gate_needs_recent_contact_with_a_majority(heard: dict[str, float], expected: bool) -> None:
    view = Case(A, THREE, {}).view()   # members alive since loop time 0.0
    assert has_majority(view)
    assert has_contact_majority(view, heard, now=100.0, window=5.0) is expected


def test_a_member_just_joined_counts_from_its_arrival_until_its_first_probe() -> None:
    view = Case(A, THREE, {}).view()
    assert has_contact_majority(view, {}, now=3.0, window=5.0)   # alive since 0.0, 3 s ago


def test_a_member_turning_suspect_is_no_contact() -> None:
    """Its ``since`` moves when it turns suspect: that kept the gate open for another window after a cut (5.3-7.3 s
    measured with three agents instead of ~3 s)."""
    members = [_member(A, 0, State.ALIVE), _member(B, 0, State.SUSPECT), _member(C, 0, State.SUSPECT)]
    members = [MemberView(m.member, m.state, 99.0) if m.member.region != A else m for m in members]   # suspect at 99
    view = Quorum(local_region=A, max_age=MAX_AGE, clock=lambda: NOW).view(regions=THREE, members=members)
    assert has_majority(view)                                                   # suspect still counts as alive
    assert not has_contact_majority(view, {f"{B}-node0": 50.0, f"{C}-node0": 50.0}, now=100.0, window=5.0)
    assert not has_contact_majority(view, {}, now=100.0, window=5.0)           # never heard, only suspected


def test_a_region_whose_agents_have_not_reported_since_they_started_is_out() -> None:
    """What the store holds of it is from before its agents started (a copy that broke meanwhile would be
    answered): out until one of its agents has reported and this agent holds that report, then back."""
    def view(meta: tuple[tuple[str, str], ...], second: tuple[tuple[str, str], ...] | None = None,
             reports: dict[str, int] | None = None) -> ClusterView:
        members = [_member(A, 0, State.ALIVE), _member(C, 0, State.ALIVE)]
        b = [MemberView(Member(f"{B}/node0", B, "node0", Role.AGENT, Address("127.0.0.9", 7946), meta), State.ALIVE,
                        0.0)]
        if second is not None:
            b.append(MemberView(Member(f"{B}/node1", B, "node1", Role.AGENT, Address("127.0.0.8", 7946), second),
                                State.ALIVE, 0.0))
        return Quorum(local_region=A, max_age=MAX_AGE, clock=lambda: NOW).view(regions=THREE, members=members + b,
                                                                               reports=reports)

    pending, unchanged, fresh = (("copies", "pending"),), (("copies", "0"),), (("copies", "5000"),)
    verdict = region_verdict(view(pending), B)
    assert verdict.status is Status.OUT and "returning" in verdict.reason
    assert region_verdict(view(unchanged), B).status is Status.UP             # nothing changed since: current
    assert region_verdict(view(fresh), B).status is Status.OUT               # announced before it arrived here
    assert region_verdict(view(fresh, reports={f"{B}/node0": 4000}), B).status is Status.OUT
    assert region_verdict(view(fresh, reports={f"{B}/node0": 5000}), B).status is Status.UP
    assert region_verdict(view(pending, unchanged), B).status is Status.UP   # one of its agents has reported
    assert region_verdict(view(()), B).status is Status.UP                   # an agent that does not say


def test_an_announced_report_overwritten_by_its_regions_other_agent_still_counts() -> None:
    """Two agents of a region write the same copy keys and anti-entropy carries only the newest version,
    so node0's announced report may never arrive once node1 overwrote it: a newer report of the region
    counts (seen in tests/e2e/test_graceful_restart.py: the region left when node1 stopped)."""
    members = [_member(A, 0, State.ALIVE), _member(C, 0, State.ALIVE),
               MemberView(Member(f"{B}/node0", B, "node0", Role.AGENT, Address("127.0.0.9", 7946),
                                 (("copies", "5000"),)), State.ALIVE, 0.0)]

    def view(region_reports: dict[str, int]) -> ClusterView:
        return Quorum(local_region=A, max_age=MAX_AGE, clock=lambda: NOW).view(
            regions=THREE, members=members, reports={f"{B}/node1": 6000}, region_reports=region_reports)

    assert region_verdict(view({B: 6000}), B).status is Status.UP
    assert region_verdict(view({B: 4000}), B).status is Status.OUT          # older than announced: not yet
    assert region_verdict(view({C: 9000}), B).status is Status.OUT          # another region's reports: no
