"""What this agent itself observed about copies: local, never replicated, never a write to the store.

A copy's health in the replicated store is written only by its owner (the copy's region).
What this agent's own HTTP checks see of *other* regions' copies (and, in standalone mode,
of every copy) is an observation: it lives here, beside the store, and the zone compiler
reads both through :class:`ObservedState`. So a check can never overwrite another region's
report, and a replicated store carries only what its owners said.

A copy is answered when neither says otherwise: the owner's report (if any) says healthy
and this agent's observation (if any) says healthy. Addresses either side saw fail are
left out. The zone serial stays a function of the replicated state alone; like PowerDNS's
``ifurlup``, a health flip observed here changes answers, not the serial.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from region_agent.state.model import Challenge, CopyHealth, Fence, Project, Region
from region_agent.state.store import StateView

CopyId = tuple[str, str]  # (slug, region)
ObservationListener = Callable[[list[CopyId]], None]


class Observations:
    """This agent's own view of copies' health, with change listeners like the store's."""

    def __init__(self) -> None:
        self._copies: dict[CopyId, CopyHealth] = {}
        self._listeners: list[ObservationListener] = []

    @property
    def copies(self) -> Mapping[CopyId, CopyHealth]:
        return self._copies

    def get(self, copy: CopyId) -> CopyHealth | None:
        return self._copies.get(copy)

    def put(self, copy: CopyId, health: CopyHealth) -> bool:
        """Record an observation; listeners hear of it only when it changed anything."""
        if self._copies.get(copy) == health:
            return False
        self._copies[copy] = health
        self._notify([copy])
        return True

    def forget(self, copies: list[CopyId]) -> None:
        """Drop observations of copies no longer checked (a project or region removed)."""
        gone = [copy for copy in copies if self._copies.pop(copy, None) is not None]
        if gone:
            self._notify(gone)

    def subscribe(self, listener: ObservationListener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _notify(self, copies: list[CopyId]) -> None:
        for listener in list(self._listeners):
            listener(copies)


def combine(reported: CopyHealth | None, observed: CopyHealth | None) -> CopyHealth | None:
    """One copy's health from its owner's report and this agent's observation (pure)."""
    if observed is None:
        return reported
    if reported is None:
        return observed
    failed = tuple(dict.fromkeys(reported.failed_addresses + observed.failed_addresses))
    if not reported.healthy:
        return CopyHealth(False, reported.reason, failed)
    if not observed.healthy:
        return CopyHealth(False, observed.reason, failed)
    return CopyHealth(True, reported.reason, failed)


class CombinedCopies(Mapping[CopyId, CopyHealth]):
    """The store's copies and the observations as one read-only mapping, combined on lookup."""

    def __init__(self, reported: Mapping[CopyId, CopyHealth], observed: Mapping[CopyId, CopyHealth]) -> None:
        self._reported = reported
        self._observed = observed

    def __getitem__(self, copy: CopyId) -> CopyHealth:
        health = combine(self._reported.get(copy), self._observed.get(copy))
        if health is None:
            raise KeyError(copy)
        return health

    def get(self, copy: CopyId, default: object = None) -> CopyHealth | None:  # type: ignore[override]
        health = combine(self._reported.get(copy), self._observed.get(copy))
        return health if health is not None else default  # type: ignore[return-value]

    def __iter__(self) -> Iterator[CopyId]:
        yield from self._reported
        yield from (copy for copy in self._observed if copy not in self._reported)

    def __len__(self) -> int:
        return len(self._reported) + sum(1 for copy in self._observed if copy not in self._reported)


class ObservedState:
    """A :class:`StateView` of the replicated state with this agent's observations laid over it."""

    def __init__(self, state: StateView, observations: Observations) -> None:
        self._state = state
        self._observations = observations

    @property
    def regions(self) -> Mapping[str, Region]:
        return self._state.regions

    @property
    def projects(self) -> Mapping[str, Project]:
        return self._state.projects

    @property
    def copies(self) -> Mapping[CopyId, CopyHealth]:
        return CombinedCopies(self._state.copies, self._observations.copies)

    @property
    def challenges(self) -> Mapping[str, Mapping[bytes, Challenge]]:
        return self._state.challenges

    @property
    def fenced(self) -> Mapping[str, Fence]:
        return self._state.fenced

    @property
    def newest_hlc(self) -> int:
        return self._state.newest_hlc  # the serial follows replicated state only
