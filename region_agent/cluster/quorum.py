"""Whether a region stays in the answers, decided by a majority of vantage points: pure rules.

Everything here is a function of one :class:`ClusterView` (what this agent knows at one
instant: its membership view, the configured regions, fences and the observations other
regions gossiped, and the time); nothing does I/O or reads a clock. :class:`Quorum` builds
views with an injected clock.

Terms:

- **known regions**: the configured regions (the store's region records) and every region
  with a member in the membership view that has not left, witness regions included;
- **alive**: a region with any member ALIVE or SUSPECT in this agent's view (this agent's own
  region always is); a **witness region** is one whose members are all ``Role.WITNESS``:
  it serves no copies and no DNS, it only adds a vantage point;
- **vantage points** for a region R: the alive regions other than R;
- an **observation** is one observing region's latest verdict about another region, of one
  :class:`Aspect` (its ingress data path, or whether its agents answer gossip), stamped with
  the wall-clock time it was made; older than ``max_age`` it does not count.

Rules (:func:`region_verdict`), in order:

1. a fenced region is out (:attr:`Status.FENCED`);
2. **silence**: a region with no agent alive in this view is out only when a strict majority
   of its vantage points say so (this agent's own membership view is its vote; every other
   region's vote is its fresh liveness observation; a region with no fresh observation
   does not agree);
3. **ingress**: a region's ingress is down only when a strict majority of its vantage
   points observe it down (fresh observations only, one vote per observing region: its
   latest);
4. **no majority can exist** when the cluster knows fewer than three regions (two regions and
   no witness): a region silent or observed down by the only other region is
   :attr:`Status.CONTESTED`, and the per-project or per-zone :class:`Policy` decides:
   ``hold`` keeps answering it, ``failover`` drops it;
5. **minority**: an agent that does not see a strict majority of the known regions alive
   (:func:`has_majority`) removes nobody (:attr:`Status.HELD`): it can not tell its own
   isolation from the others' failure. The same test gates the control API's writes.
6. **one vantage point**: when this agent's region is the only live one besides the region
   judged (a third region silent), its vote alone is no majority: :attr:`Status.CONTESTED`, as
   with two regions. An agent being cut off from the others loses them one at a time and sees
   this before its own minority; without the rule it would drop a region on its own probe.

So a cut link between two regions of three never takes either out (the third region's vote
is missing from the majority), an isolated region is dropped by the others once their
observations agree and keeps answering every region itself, and with two regions only a
witness (or the ``failover`` policy) lets one drop the other.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from region_agent.gossip.membership import MemberView
from region_agent.gossip.messages import Role, State

__all__ = [
    "Aspect", "ClusterView", "Observation", "Policy", "Quorum", "Status", "Verdict", "alive_regions",
    "has_contact_majority", "has_majority", "ingress_verdict", "known_regions", "latest_observations",
    "liveness_observations", "liveness_verdict", "region_verdict", "regions_in_answers", "verdicts", "witness_regions",
]

_LIVE_STATES = frozenset((State.ALIVE, State.SUSPECT))


class Policy(enum.StrEnum):
    """What to do with a contested region when no majority can exist (two regions, no witness)."""

    HOLD = "hold"  # keep answering the silent region: a partition never empties an answer
    FAILOVER = "failover"  # drop it: a dead region leaves the answers, a partition splits them


class Aspect(enum.StrEnum):
    INGRESS = "ingress"  # the region's ingress data path, probed by the observer
    LIVENESS = "liveness"  # whether the region's agents answer the observer's gossip


class Status(enum.StrEnum):
    UP = "up"
    OUT = "out"  # a strict majority of vantage points agrees it is silent or its ingress is down
    FENCED = "fenced"
    CONTESTED = "contested"  # no majority can exist: the policy decides
    HELD = "held"  # this agent is in a minority: it removes nobody


@dataclass(frozen=True, slots=True)
class Observation:
    """One observing region's verdict about another region (gossiped; owned by the observer)."""

    aspect: Aspect
    observer: str
    subject: str
    up: bool
    observed_at: float  # wall-clock seconds


@dataclass(frozen=True, slots=True)
class Verdict:
    region: str
    status: Status
    reason: str
    down_votes: int = 0  # vantage points that agree it is silent / its ingress is down
    vantage_points: int = 0

    def in_answers(self, policy: Policy = Policy.HOLD) -> bool:
        if self.status is Status.CONTESTED:
            return policy is Policy.HOLD
        return self.status in (Status.UP, Status.HELD)


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What one agent knows at one instant; every rule is a function of it."""

    local_region: str
    regions: frozenset[str]  # configured regions: the ones answers are made of
    members: tuple[MemberView, ...]
    now: float  # wall-clock seconds, the clock of Observation.observed_at
    max_age: float  # observations older than this do not count
    fenced: frozenset[str] = frozenset()
    observations: tuple[Observation, ...] = ()
    witnesses: frozenset[str] = frozenset()  # registered witness regions: they vote, answers hold none of them
    reports: Mapping[str, int] = field(default_factory=dict)  # writer id → HLC of its newest copy report held
    # region → HLC of the newest copy report of that region's copies held, whoever wrote it
    region_reports: Mapping[str, int] = field(default_factory=dict)


class Quorum:
    """Builds :class:`ClusterView` s with an injected wall clock (seconds)."""

    def __init__(self, *, local_region: str, max_age: float, clock: Callable[[], float]) -> None:
        if max_age <= 0:
            raise ValueError("max_age must be positive")
        self.local_region = local_region
        self.max_age = max_age
        self._clock = clock

    def view(self, *, regions: Iterable[str], members: Iterable[MemberView], fenced: Iterable[str] = (),
             observations: Iterable[Observation] = (), witnesses: Iterable[str] = (),
             reports: Mapping[str, int] | None = None,
             region_reports: Mapping[str, int] | None = None) -> ClusterView:
        return ClusterView(self.local_region, frozenset(regions), tuple(members), self._clock(), self.max_age,
                           frozenset(fenced), tuple(observations), frozenset(witnesses), reports or {},
                           region_reports or {})


# --- membership ---------------------------------------------------------------------------


def known_regions(view: ClusterView) -> frozenset[str]:
    """The regions that vote: the configured ones and the registered witnesses (and this agent's own).
    Never what the membership remembers: a member of a region nobody configured has no vote, and a
    registered witness that is gone still counts, as a dead vantage point."""
    return frozenset(view.regions | view.witnesses | {view.local_region})


def alive_regions(view: ClusterView) -> frozenset[str]:
    """Known regions with a member alive (or suspect); this agent's own always."""
    known = known_regions(view)
    alive = {m.member.region for m in view.members if m.state in _LIVE_STATES and m.member.region in known}
    return frozenset(alive | {view.local_region})


def witness_regions(view: ClusterView) -> frozenset[str]:
    """The registered witness regions."""
    return view.witnesses


def has_majority(view: ClusterView) -> bool:
    """This agent sees a strict majority of the known regions (witnesses included) alive."""
    known = known_regions(view)
    return 2 * len(alive_regions(view) & known) > len(known)


def has_contact_majority(view: ClusterView, heard_at: Mapping[str, float], now: float, window: float) -> bool:
    """A strict majority of known regions was *heard from* within ``window`` (this agent's own region
    always is). ``heard_at``: member name → when this agent last got an ack from it, in the same
    clock as ``now``; a member never probed yet counts from when it became alive (``since``).

    The write gate adds this to :func:`has_majority`: SWIM takes a suspicion timeout per member to
    declare the others dead, and an agent that has just been cut off would accept writes until then;
    with this it refuses them within two probe intervals.
    """
    heard = {view.local_region}
    for m in view.members:
        if m.state not in _LIVE_STATES:
            continue
        # Contact is an ack or a ping, nothing else: a member turning suspect (its ``since`` moves) has
        # not been heard from. One never probed yet counts from when it became alive.
        last = heard_at.get(m.member.name, m.since if m.state is State.ALIVE else None)
        if last is not None and now - last <= window:
            heard.add(m.member.region)
    known = known_regions(view)
    return 2 * len(heard & known) > len(known)


def liveness_observations(view: ClusterView) -> list[Observation]:
    """What this agent's region says about every other known region's liveness (to gossip)."""
    alive = alive_regions(view)
    return [Observation(Aspect.LIVENESS, view.local_region, region, region in alive, view.now)
            for region in sorted(known_regions(view) - {view.local_region})]


def latest_observations(view: ClusterView, aspect: Aspect) -> dict[tuple[str, str], Observation]:
    """(observer, subject) → the observer's latest fresh observation of ``aspect``."""
    oldest = view.now - view.max_age
    latest: dict[tuple[str, str], Observation] = {}
    for obs in view.observations:
        if obs.aspect is not aspect or obs.observed_at < oldest or obs.observer == obs.subject:
            continue
        pair = (obs.observer, obs.subject)
        best = latest.get(pair)
        if best is None or obs.observed_at > best.observed_at:
            latest[pair] = obs
    return latest


# --- verdicts -----------------------------------------------------------------------------


def _decide(view: ClusterView, region: str, down: int, vantage: int, what: str) -> Verdict:
    """The common end of both rules once ``down`` of ``vantage`` points say ``what``."""
    if len(known_regions(view) - {region}) < 2:
        return Verdict(region, Status.CONTESTED, f"{what} seen by {down} of {vantage}; no third vantage point "
                       f"(two regions, no witness): the policy decides", down, vantage)
    if not has_majority(view):
        return Verdict(region, Status.HELD, f"{what} seen by {down} of {vantage}, but this agent sees no majority "
                       f"of regions alive: it removes nobody", down, vantage)
    if vantage < 2:
        # Only this agent's region can see the region (the third one is silent): one vote is no
        # quorum, however many regions are configured; an agent that is being cut off sees this
        # before it sees its own minority.
        return Verdict(region, Status.CONTESTED, f"{what} seen by {down} of {vantage}; no other live vantage point: "
                       f"the policy decides", down, vantage)
    if 2 * down > vantage:
        return Verdict(region, Status.OUT, f"{what}: {down} of {vantage} vantage points agree", down, vantage)
    return Verdict(region, Status.UP, f"{what} seen by {down} of {vantage} vantage points: no majority", down,
                   vantage)


# Member metadata: "pending" from an agent's start until it has reported its copies; then the HLC of
# the newest copy report it had written by then ("0": nothing changed, the store's reports are right).
REPORTS_META = "copies"
REPORTS_PENDING = "pending"


def _reported(view: ClusterView, member: MemberView) -> bool:
    said = member.member.metadata.get(REPORTS_META)
    if said is None:
        return True   # an agent that does not say (a lab, an older one): taken as before
    if not said.isdigit():
        return False
    # Its reports count once this agent holds them: an announcement can overtake the entries it names.
    # A newer report of the same region by another writer counts too: two agents of a region write the
    # same copy keys, and anti-entropy carries only the newest version, so the announced one may never
    # arrive once its region's other agent has overwritten it.
    wanted = int(said)
    return (wanted == 0 or view.reports.get(member.member.name, 0) >= wanted
            or view.region_reports.get(member.member.region, 0) >= wanted)


def returning(view: ClusterView, region: str) -> bool:
    """No live agent of ``region`` has reported its copies since it started (or its reports have not
    arrived here yet): what the store holds of the region is from before (a copy deleted or broken
    meanwhile would still be answered)."""
    agents = [m for m in view.members if m.member.region == region and m.state in _LIVE_STATES
              and m.member.role is Role.AGENT]
    return bool(agents) and not any(_reported(view, m) for m in agents)


def liveness_verdict(view: ClusterView, region: str) -> Verdict:
    alive = alive_regions(view)
    vantage = alive - {region}
    if region in alive:
        if region != view.local_region and returning(view, region):
            return Verdict(region, Status.OUT, "returning: no copy report since its agents started", 0,
                           len(vantage))
        return Verdict(region, Status.UP, "alive", 0, len(vantage))
    latest = latest_observations(view, Aspect.LIVENESS)
    down = 1 + sum(1 for v in vantage - {view.local_region}
                   if (obs := latest.get((v, region))) is not None and not obs.up)
    return _decide(view, region, down, len(vantage), "silent")


def ingress_verdict(view: ClusterView, region: str) -> Verdict:
    vantage = alive_regions(view) - {region}
    latest = latest_observations(view, Aspect.INGRESS)
    down = sum(1 for v in vantage if (obs := latest.get((v, region))) is not None and not obs.up)
    if down == 0:
        return Verdict(region, Status.UP, "ingress up", 0, len(vantage))
    return _decide(view, region, down, len(vantage), "ingress down")


def region_verdict(view: ClusterView, region: str) -> Verdict:
    if region in view.fenced:
        return Verdict(region, Status.FENCED, "fenced by the control plane")
    liveness = liveness_verdict(view, region)
    if liveness.status is not Status.UP:
        return liveness
    return ingress_verdict(view, region)


def verdicts(view: ClusterView) -> dict[str, Verdict]:
    """A verdict for every configured region."""
    return {region: region_verdict(view, region) for region in sorted(view.regions)}


def regions_in_answers(view: ClusterView, policy: Policy = Policy.HOLD) -> frozenset[str]:
    """The configured regions in the answers under one policy (a project's, or the zone's)."""
    return frozenset(region for region, verdict in verdicts(view).items() if verdict.in_answers(policy))
