"""State snapshot → :class:`ZoneTables`: the whole zone, rendered ahead of the queries.

The zone for apex Z holds:

* Z: SOA (serial from the state, see :func:`zone_serial`) and NS ``ns-<region>.Z`` for
  every region with a name-server address, with glue A/AAAA in the additional section;
* ``ns-<region>.Z``: the glue addresses;
* ``<slug>.Z``: each project's A/AAAA, TTL ``record_ttl`` (30 s), chosen by
  :mod:`region_agent.globaldns.selection` (``ha``) or per client (``proximity``). A fenced region
  (``state.fenced``) is left out of every project's answers, the all-down ones included.

Every name is compiled for A, AAAA, NS, SOA, ANY and NODATA, so a query costs a dict
lookup; only proximity answers are chosen per query, by the :class:`Locator`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from region_agent.globaldns.records import (
    EMPTY,
    Section,
    SoaFields,
    address_records,
    ns_records,
    rfc8482_hinfo,
    soa_record,
    suffix_offsets,
    txt_records,
)
from region_agent.globaldns.selection import Outcome, Selection, all_down, ifurlup
from region_agent.globaldns.tables import (
    CompiledProject,
    Locator,
    Node,
    ProximityAnswer,
    Reply,
    ZoneTables,
    negative_reply_factory,
)
from region_agent.globaldns.wire import AAAA, NOERROR, NS, SERVFAIL, SOA, TXT, A, name_from_text, name_to_text
from region_agent.state.model import AllDownPolicy, Challenge, CopyHealth, Mode, Project, Region
from region_agent.state.serial import zone_serial
from region_agent.state.store import StateView

FAMILIES = ((A, 4), (AAAA, 6))


@dataclass(frozen=True, slots=True)
class ZoneConfig:
    apex: str
    record_ttl: int = 30
    ns_ttl: int = 3600
    soa_ttl: int = 3600
    soa_mname: str | None = None  # default: the first ns-<region> host
    hostmaster: str | None = None  # default: hostmaster.<apex>
    refresh: int = 3600
    retry: int = 600
    expire: int = 604_800
    minimum: int = 60
    startup_answer: AllDownPolicy = AllDownPolicy.ALL

    @property
    def negative_ttl(self) -> int:
        return min(self.soa_ttl, self.minimum)  # RFC 2308 §5


@dataclass
class CompileReport:
    """What the compiler could not honour; logged and counted by the caller. ``left_out``: names that are
    not DNS names, skipped (a subset of ``problems``; the zone service reports them as degraded)."""

    problems: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)

    def leave_out(self, problem: str) -> None:
        self.problems.append(problem)
        self.left_out.append(problem)


def ns_host(region: str, apex: str) -> str:
    return f"ns-{region}.{apex}"


def _health(copy: CopyHealth | None, address: str) -> bool:
    return copy is not None and copy.healthy and address not in copy.failed_addresses


def compile_zone(
    state: StateView,
    config: ZoneConfig,
    *,
    health_known: bool = True,
    locator: Locator | None = None,
    report: CompileReport | None = None,
    previous: ZoneTables | None = None,
    changed_projects: Collection[str] | None = None,
) -> ZoneTables:
    """Compile the zone; with ``previous`` and ``changed_projects``, recompile only those projects.

    A project's records depend on the project, its regions and its copies' health, and on
    the settings below; when none of the latter changed since ``previous`` (its ``basis``),
    every project not named in ``changed_projects`` is reused as compiled. A health flip
    then costs one project, not the whole zone (10,000 projects: ~0.7 s in full).
    """
    build = ZoneBuild(state, config, health_known=health_known, locator=locator, report=report,
                      previous=previous, changed_projects=changed_projects)
    build.step()
    return build.finish()


class ZoneBuild:
    """One compilation (see :func:`compile_zone`) done in steps, so a caller can yield between them.

    The regions and settings are fixed when the build starts; each project is read from
    ``state`` when its turn comes. A caller that lets the state change between steps must
    compile again the projects changed meanwhile (the zone service does: they are in its
    next changed set).
    """

    def __init__(
        self,
        state: StateView,
        config: ZoneConfig,
        *,
        health_known: bool = True,
        locator: Locator | None = None,
        report: CompileReport | None = None,
        previous: ZoneTables | None = None,
        changed_projects: Collection[str] | None = None,
    ) -> None:
        self.report = report if report is not None else CompileReport()
        self._state, self._config, self._health_known, self._locator = state, config, health_known, locator
        self._apex = name_from_text(config.apex)
        self._regions = dict(sorted(state.regions.items()))
        self._fenced = frozenset(state.fenced)
        self._basis = (config, health_known, locator, tuple(self._regions.items()), tuple(sorted(self._fenced)))
        self._infra = _compile_infrastructure(self._apex, self._regions, config, zone_serial(state), self.report)
        if previous is not None and changed_projects is not None and previous.basis == self._basis:
            self._projects = dict(previous.projects)
            self._nodes = dict(previous.nodes)
            for owner in previous.challenge_owners:
                self._nodes.pop(owner, None)
            dirty = list(changed_projects)
        else:
            self._projects, self._nodes, dirty = {}, {}, list(state.projects.keys())
        self._nodes.update(self._infra.nodes)
        self._challenges = _challenge_nodes(self._apex, state.challenges, config, self._infra.nodes, self.report)
        self._nodes.update(self._challenges)
        self._dirty = iter(dirty)
        self.compiled = 0  # projects compiled so far

    def step(self, budget: float | None = None) -> bool:
        """Compile projects for about ``budget`` seconds (None: all); True when none is left."""
        if budget is None:
            for slug in self._dirty:
                self._compile(slug)
            return True
        deadline = time.perf_counter() + budget
        for count, slug in enumerate(self._dirty, 1):
            self._compile(slug)
            if count % 16 == 0 and time.perf_counter() >= deadline:
                return False
        return True

    def _compile(self, slug: str) -> None:
        config, infra, report = self._config, self._infra, self.report
        old = self._projects.pop(slug, None)
        if old is not None:
            self._nodes.pop(old.owner, None)
        project = self._state.projects.get(slug)
        if project is None:
            return
        try:
            owner = name_from_text(f"{slug}.{config.apex}")
        except ValueError as exc:  # every entrance refuses such a name; one that got in anyway costs only itself
            report.leave_out(f"project {slug}: left out, its name is not a DNS name ({exc})")
            return
        if owner in infra.nodes:
            report.problems.append(f"project {slug}: name {slug}.{config.apex} is taken by a name server")
            return
        missing = [r for r in project.regions if r not in self._regions]
        if missing:
            report.problems.append(f"project {slug}: unknown region(s) {', '.join(missing)} left out")
        compiled = _compile_project(owner, project, self._regions, self._state.copies, config, self._health_known,
                                    self._locator, self._fenced)
        self._projects[slug] = compiled
        self._nodes[owner] = compiled.node
        self.compiled += 1

    def finish(self) -> ZoneTables:
        """The tables (call once :meth:`step` returned True)."""
        infra = self._infra
        negative = negative_reply_factory(infra.soa_at)
        # Project names are one label below the apex, so only infrastructure and challenge
        # names can leave empty non-terminals between themselves and the apex.
        ents = _empty_nonterminals([*infra.nodes, *self._challenges], self._apex) - self._nodes.keys()
        description = (*infra.description, *_challenge_description(self._state.challenges))
        return ZoneTables(self._apex, infra.serial, self._nodes, ents, negative, description, self._projects,
                          self._basis, challenge_owners=frozenset(self._challenges))


def _name_servers(regions: Iterable[Region], apex: str,
                  report: CompileReport) -> tuple[list[Region], tuple[bytes, ...]]:
    """The regions with name-server addresses and their ns-<region> names, in wire form; a region whose
    name can not be one is left out and reported (every entrance refuses it; a compile must not fail)."""
    servers: list[Region] = []
    hosts: list[bytes] = []
    for region in regions:
        if not (region.ns_ipv4 or region.ns_ipv6):
            continue
        try:
            hosts.append(name_from_text(ns_host(region.name, apex)))
        except ValueError as exc:
            report.leave_out(f"region {region.name}: name server left out, not a DNS name ({exc})")
            continue
        servers.append(region)
    return servers, tuple(hosts)


@dataclass
class _Infrastructure:
    serial: int
    nodes: dict[bytes, Node]
    soa_at: Callable[[int], Section]  # the SOA for negative answers, given the apex's offset
    description: tuple[dict[str, object], ...]


def _compile_infrastructure(apex: bytes, regions: Mapping[str, Region], config: ZoneConfig,
                            serial: int, report: CompileReport) -> _Infrastructure:
    """The apex (SOA, NS with glue) and the name servers' own names."""
    ns_regions, ns_hosts = _name_servers(regions.values(), config.apex, report)
    mname = name_from_text(config.soa_mname) if config.soa_mname else (ns_hosts[0] if ns_hosts else
                                                                        name_from_text(f"ns.{config.apex}"))
    rname = name_from_text(config.hostmaster or f"hostmaster.{config.apex}")
    soa = SoaFields(mname, rname, serial, config.refresh, config.retry, config.expire, config.minimum)

    def soa_at(apex_offset: int, ttl: int = config.negative_ttl) -> Section:
        return soa_record(apex, soa, ttl, suffix_offsets(apex, apex_offset))

    nodes: dict[bytes, Node] = {}
    apex_suffixes = suffix_offsets(apex)
    glue = EMPTY
    for region, host in zip(ns_regions, ns_hosts, strict=True):
        glue = glue + address_records(host, region.ns_ipv4 + region.ns_ipv6, config.ns_ttl, apex_suffixes)
    apex_replies = {SOA: Reply(NOERROR, aa=True, answer=soa_at(12, config.soa_ttl))}
    if ns_hosts:
        apex_replies[NS] = Reply(
            NOERROR, aa=True, answer=ns_records(apex, ns_hosts, config.ns_ttl, apex_suffixes), additional=glue
        )
    nodes[apex] = _node(apex, apex_replies, config)
    description: list[dict[str, object]] = [
        {"name": config.apex, "type": "SOA", "serial": serial, "mname": _text(mname)}]
    for region, host in zip(ns_regions, ns_hosts, strict=True):
        suffixes = suffix_offsets(host)
        replies: dict[int, Reply] = {}
        for qtype, family in FAMILIES:
            addresses = region.ns_ipv4 if family == 4 else region.ns_ipv6
            if addresses:
                replies[qtype] = Reply(NOERROR, aa=True, answer=address_records(host, addresses, config.ns_ttl,
                                                                                  suffixes))
        nodes[host] = _node(host, replies, config)
        description.append({"name": _text(host), "type": "NS glue",
                            "addresses": list(region.ns_ipv4 + region.ns_ipv6)})
    return _Infrastructure(serial, nodes, soa_at, tuple(description))


def _challenge_nodes(apex: bytes, challenges: Mapping[str, Mapping[bytes, Challenge]], config: ZoneConfig,
                     taken: Mapping[bytes, Node], report: CompileReport) -> dict[bytes, Node]:
    """One node per name holding ACME challenge TXT records (their other types: NODATA)."""
    nodes: dict[bytes, Node] = {}
    for name, values in challenges.items():
        try:
            owner = name_from_text(name)
        except ValueError as exc:  # the model refuses such a name; skipped, not fatal, if one got in
            report.leave_out(f"challenge {name[:64]}: left out, not a DNS name ({exc})")
            continue
        if owner in taken or not owner.endswith(apex):
            continue  # the update policy never lets this happen; a peer's entry might
        records = txt_records(owner, [(c.rdata, c.ttl) for c in values.values()], suffix_offsets(owner))
        nodes[owner] = _node(owner, {TXT: Reply(NOERROR, aa=True, answer=records)}, config)
    return nodes


def _challenge_description(challenges: Mapping[str, Mapping[bytes, Challenge]]) -> list[dict[str, object]]:
    return [{"name": name.rstrip("."), "type": "TXT", "values": len(values),
             "ttl": sorted({c.ttl for c in values.values()}),
             "expires_at": min(c.expires_at for c in values.values())} for name, values in sorted(challenges.items())]


def _node(owner: bytes, replies: dict[int, Reply], config: ZoneConfig,
          dynamic: Mapping[int, ProximityAnswer] | None = None) -> Node:
    any_reply = Reply(NOERROR, aa=True, answer=rfc8482_hinfo(owner, config.record_ttl, suffix_offsets(owner)))
    return Node(replies, dynamic or {}, any_reply)




def _compile_project(
    owner: bytes,
    project: Project,
    regions: Mapping[str, Region],
    copies: Mapping[tuple[str, str], CopyHealth],
    config: ZoneConfig,
    health_known: bool,
    locator: Locator | None,
    fenced: Collection[str] = frozenset(),
) -> CompiledProject:
    suffixes = suffix_offsets(owner)
    ttl = config.record_ttl

    def reply_for(selection: Selection) -> Reply:
        if selection.outcome is Outcome.SERVFAIL:
            return Reply(SERVFAIL, aa=False)
        return Reply(NOERROR, aa=True, answer=address_records(owner, selection.addresses, ttl, suffixes))

    replies: dict[int, Reply] = {}
    dynamic: dict[int, ProximityAnswer] = {}
    targets: list[dict[str, object]] = []
    answers: dict[str, object] = {}
    for region_name in project.regions:
        region = regions.get(region_name)
        copy = copies.get((project.slug, region_name))
        targets.append({
            "region": region_name,
            "addresses": list(region.ipv4 + region.ipv6) if region else [],
            "health": "fenced" if region_name in fenced else
                      "unknown" if copy is None else ("healthy" if copy.healthy else "unhealthy"),
            "reason": "" if copy is None else copy.reason,
            "failed_addresses": [] if copy is None else list(copy.failed_addresses),
        })
    for qtype, family in FAMILIES:
        groups = [
            [(address, health_known and _health(copies.get((project.slug, r)), address))
             for r in group if r in regions and r not in fenced for address in regions[r].addresses(family)]
            for group in project.groups
        ]
        if not health_known:
            selection = all_down(groups, config.startup_answer, "first health round not finished")
            if not any(groups):
                selection = Selection(Outcome.NODATA, (), "no address of this family")
        elif project.mode is Mode.HA:
            selection = ifurlup(groups, project.all_down)
        else:
            proximity = _proximity(owner, project, regions, copies, family, ttl, suffixes, locator, fenced)
            if proximity is not None:
                dynamic[qtype] = proximity
                answers["A" if family == 4 else "AAAA"] = {
                    "proximity": sorted(proximity.by_region), "locator": locator is not None,
                }
                continue
            selection = all_down(groups, project.all_down, "all down") if any(groups) else Selection(
                Outcome.NODATA, (), "no address of this family")
        answers["A" if family == 4 else "AAAA"] = {"addresses": list(selection.addresses), "why": selection.why,
                                                   "outcome": selection.outcome.value}
        if selection.outcome is not Outcome.NODATA:
            replies[qtype] = reply_for(selection)
    description: dict[str, object] = {
        "name": f"{project.slug}.{config.apex}", "type": "project", "mode": project.mode.value,
        "primary": project.primary, "all_down": project.all_down.value, "ttl": ttl,
        "answers": answers, "targets": targets,
    }
    return CompiledProject(owner, _node(owner, replies, config, dynamic), description)


def _proximity(
    owner: bytes,
    project: Project,
    regions: Mapping[str, Region],
    copies: Mapping[tuple[str, str], CopyHealth],
    family: int,
    ttl: int,
    suffixes: dict[bytes, int],
    locator: Locator | None,
    fenced: Collection[str] = frozenset(),
) -> ProximityAnswer | None:
    """Per-region replies for the healthy regions, or None when none is healthy."""
    by_region: dict[str, Reply] = {}
    every: list[str] = []
    for name in project.regions:
        region = regions.get(name)
        if region is None or name in fenced:
            continue
        copy = copies.get((project.slug, name))
        healthy = tuple(a for a in region.addresses(family) if _health(copy, a))
        if healthy:
            by_region[name] = Reply(NOERROR, aa=True, answer=address_records(owner, healthy, ttl, suffixes))
            every.extend(healthy)
    if not by_region:
        return None
    located = frozenset(n for n in by_region if regions[n].latitude is not None)
    unlocated = Reply(NOERROR, aa=True, answer=address_records(owner, tuple(every), ttl, suffixes))
    return ProximityAnswer(by_region, located, unlocated, locator)


def _empty_nonterminals(names: Iterable[bytes], apex: bytes) -> frozenset[bytes]:
    """Names between a node and the apex that own nothing themselves (RFC 8020: NODATA)."""
    existing = set(names)
    ents: set[bytes] = set()
    for name in existing:
        i = name[0] + 1
        while len(name) - i > len(apex):
            parent = name[i:]
            if parent not in existing:
                ents.add(parent)
            i += name[i] + 1
    return frozenset(ents)


def _text(wire: bytes) -> str:
    return name_to_text(wire).rstrip(".")


__all__ = ["CompileReport", "ZoneBuild", "ZoneConfig", "compile_zone", "ns_host", "zone_serial"]
