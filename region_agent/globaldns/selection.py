"""Which addresses a project answers, given its copies' health: pure, named after PowerDNS.

``ifurlup`` follows PowerDNS 4.7's ``ifurlup(url, {{primary...}, {backup...}},
{selector='all', backupSelector='all'})``: the first group with a healthy address gives all
its healthy addresses; when no address is healthy the all-down policy decides (PowerDNS's
``backupSelector='all'`` answers every address of every group, our default ``all``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from region_agent.state.model import AllDownPolicy

Candidate = tuple[str, bool]  # (address, healthy)


class Outcome(enum.Enum):
    ANSWER = "answer"
    NODATA = "nodata"
    SERVFAIL = "servfail"


@dataclass(frozen=True, slots=True)
class Selection:
    outcome: Outcome
    addresses: tuple[str, ...] = ()
    why: str = ""


def all_down(groups: Sequence[Sequence[Candidate]], policy: AllDownPolicy, why: str) -> Selection:
    """The answer when no address may be chosen on health: the policy decides."""
    if policy is AllDownPolicy.ALL:
        addresses = tuple(address for group in groups for address, _ in group)
        return Selection(Outcome.ANSWER if addresses else Outcome.NODATA, addresses, f"{why}: every address")
    if policy is AllDownPolicy.PRIMARY:
        addresses = tuple(address for address, _ in groups[0]) if groups else ()
        return Selection(Outcome.ANSWER if addresses else Outcome.NODATA, addresses, f"{why}: primary")
    if policy is AllDownPolicy.EMPTY:
        return Selection(Outcome.NODATA, (), f"{why}: empty answer")
    return Selection(Outcome.SERVFAIL, (), f"{why}: SERVFAIL")


def ifurlup(groups: Sequence[Sequence[Candidate]], policy: AllDownPolicy) -> Selection:
    if not any(groups):
        return Selection(Outcome.NODATA, (), "no address of this family")
    for index, group in enumerate(groups):
        healthy = tuple(address for address, ok in group if ok)
        if healthy:
            return Selection(Outcome.ANSWER, healthy, "primary healthy" if index == 0 else f"backup group {index}")
    return all_down(groups, policy, "all down")
