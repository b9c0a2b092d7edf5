"""What this region observes of the others, gossiped; and what the others observed, kept.

Two aspects per other region (``region_agent.cluster.quorum``): **liveness** (whether its agents answer
this agent's gossip: the membership view) and **ingress** (whether its ingress data path answers:
one HTTP probe per region address per interval, never per project, so probe traffic grows with
regions², not with projects). Observations travel as gossip user broadcasts (``o:`` keys), owned
by the observing region: a member can only speak for its own region. They never enter the
replicated store, so they change answers but never the zone serial.

A probe this agent could not make (out of descriptors, ports, memory) is not evidence about the
other region: that round leaves the region's ingress observation as it was.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from region_agent.base.identity import OBSERVATION, CertBook, Signer
from region_agent.base.names import region_name
from region_agent.checks.probe import CheckTarget, Outcome, new_session, probe
from region_agent.checks.rule import CheckRule, TargetHealth, TargetState
from region_agent.cluster.quorum import Aspect, ClusterView, Observation, Quorum, liveness_observations
from region_agent.cluster.settings import ClusterSettings
from region_agent.gossip.membership import MemberView
from region_agent.gossip.messages import MAX_USER_PAYLOAD, State, User
from region_agent.state.model import Kind
from region_agent.state.store import Entry, Store

logger = logging.getLogger("region_agent.cluster")

PREFIX = "o:"
MAX_OBSERVATIONS = 20_000          # (aspect, observer, subject) triples kept: regions² × 2, bounded
MAX_FUTURE_SECONDS = 60.0          # an observation stamped further ahead than this is refused (clock skew)
_ASPECTS = {"l": Aspect.LIVENESS, "i": Aspect.INGRESS}
_CODES = {aspect: code for code, aspect in _ASPECTS.items()}


class ObservationError(ValueError):
    pass


_SIGNATURE_ROOM = 200    # bytes a payload keeps free for the agent name, signer and signature


def _body(region: str, agent: str, rows: list[list[object]]) -> bytes:
    return json.dumps({"v": 2, "r": region, "a": agent, "o": rows}, separators=(",", ":"), sort_keys=True).encode()


def encode_observations(region: str, observations: Sequence[Observation], *, agent: str = "",
                        signer: Signer | None = None) -> list[bytes]:
    """One or more payloads (each within a gossip user message) carrying ``observations``, each signed
    by this agent's identity key when it has one (``agent``: its member name, ``<region>/<node>``)."""
    rows = [[_CODES[o.aspect], o.subject, int(o.up), int(o.observed_at * 1000)] for o in observations]
    bodies: list[bytes] = []
    chunk: list[list[object]] = []
    for row in rows:
        if len(_body(region, agent, [*chunk, row])) > MAX_USER_PAYLOAD - _SIGNATURE_ROOM and chunk:
            bodies.append(_body(region, agent, chunk))
            chunk = [row]
        else:
            chunk.append(row)
    if chunk:
        bodies.append(_body(region, agent, chunk))
    if signer is None:
        return bodies
    return [json.dumps({"b": body.decode(), "s": signer.fingerprint,
                        "g": base64.b64encode(signer.sign(OBSERVATION, body)).decode()},
                       separators=(",", ":")).encode() for body in bodies]


def decode_observations(payload: bytes, now: float, *, book: CertBook | None = None,
                        is_member: Callable[[str, str], bool] = lambda _agent, _region: True) -> list[Observation]:
    """Validate an observation broadcast. It speaks for one region, for the agent it names: with a
    ``book`` only when signed by that agent's certificate (which must cover the agent's region) and
    when that agent is a live member (``is_member(agent, region)``); a keyring holder can neither
    vote for a region nor keep one out. Without a book (a lab cluster) the body is taken as it is."""
    try:
        data = json.loads(payload)
        if not isinstance(data, dict):
            raise ObservationError("not an observation message")
        if book is not None:
            body, signer, sig = data["b"], data["s"], data["g"]
            if not isinstance(body, str) or not isinstance(signer, str) or not isinstance(sig, str):
                raise ObservationError("not a signed observation message")
            identity = book.get(signer)
            if identity is None:
                raise ObservationError(f"signed by an unknown certificate {signer[:40]!r}")
            raw = body.encode()
            if not identity.verify(OBSERVATION, raw, base64.b64decode(sig, validate=True)):
                raise ObservationError("the signature does not verify")
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ObservationError("not an observation message")
            region, _, node = str(data.get("a", "")).partition("/")
            if not identity.covers(region, node):
                raise ObservationError(f"certificate {identity.name} may not speak for agent {data.get('a')!r}")
        elif "b" in data:
            data = json.loads(data["b"])   # a signed message in a lab cluster: read, not checked
        if data.get("v") != 2:
            raise ObservationError("not a version 2 observation message")
        observer, agent = data["r"], data["a"]
        if not isinstance(observer, str) or not isinstance(agent, str) or agent.partition("/")[0] != observer:
            raise ObservationError(f"agent {agent!r} may not speak for region {observer!r}")
        region_name(observer)
        if not is_member(agent, observer):
            raise ObservationError(f"agent {agent} is not a live member of {observer}")
        out: list[Observation] = []
        for row in data["o"]:
            code, subject, up, stamp = row
            region_name(subject)
            if code not in _ASPECTS or up not in (0, 1) or not isinstance(stamp, int) or isinstance(stamp, bool):
                raise ObservationError(f"bad observation row {row!r}")
            at = stamp / 1000
            if at > now + MAX_FUTURE_SECONDS:
                raise ObservationError(f"observation from {observer} stamped {at - now:.0f} s in the future")
            out.append(Observation(_ASPECTS[code], observer, subject, bool(up), at))
        return out
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise ObservationError(str(exc)) from exc


class ObserverMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.probes = Counter("region_agent_cluster_ingress_probes", "Probes of other regions' ingress addresses, "
                              "by result (up, down, local-error)", ["result"], registry=registry)
        self.ingress_up = Gauge("region_agent_cluster_ingress_up",
                                "This agent's last verdict on a region's ingress (1 up, 0 down)", ["region"],
                                registry=registry)
        self.received = Counter("region_agent_cluster_observations_received",
                                "Observation broadcasts from other agents, by result (ok, refused)", ["result"],
                                registry=registry)
        self.published = Counter("region_agent_cluster_observations_published",
                                 "Observation broadcasts this agent sent", registry=registry)


class ClusterObserver:
    def __init__(self, *, region: str, settings: ClusterSettings, quorum: Quorum, store: Store,
                 members: Callable[[], Sequence[MemberView]], broadcast: Callable[[str, bytes], None],
                 member_name: str, check_host: str, check_port: int, user_agent: str,
                 registry: CollectorRegistry, wall: Callable[[], float] = time.time,
                 signer: Callable[[], Signer] | None = None, book: CertBook | None = None,
                 rule: CheckRule | None = None) -> None:
        """``signer`` and ``book``: this agent's identity key and the certificates it trusts (both None in a
        lab cluster: observations are then neither signed nor checked). ``rule``: the copy checks' fall, rise
        and re-check delay, which ingress votes follow too (one lost probe never flips a vote)."""
        self.region = region
        self.signer = signer
        self.book = book
        self.reports: dict[str, int] = {}   # writer id → HLC of its newest copy report this agent holds
        self.settings = settings
        self.quorum = quorum
        self.store = store
        self.metrics = ObserverMetrics(registry)
        self.observations: dict[tuple[Aspect, str, str], Observation] = {}
        self.ingress: dict[str, bool] = {}      # region → this agent's last ingress verdict
        self._rule = CheckRule(settings.ingress_interval, *(() if rule is None else (rule.recheck_delay, rule.fall,
                                                                                      rule.rise)))
        self._probed: dict[str, TargetState] = {}   # region → its probes' streaks (the verdict's rise/fall)
        self._next_probe = settings.ingress_interval
        self.listeners: list[Callable[[], None]] = []
        self._members = members
        self.region_reports: dict[str, int] = {}   # region → HLC of the newest report of its copies held
        for entry in store.entries():
            if entry.key[0] == Kind.COPY.value and entry.value is not None:
                self.reports[entry.version.writer] = max(self.reports.get(entry.version.writer, 0), entry.version.hlc)
                region = str(entry.key[-1])
                self.region_reports[region] = max(self.region_reports.get(region, 0), entry.version.hlc)
        store.subscribe(self._on_store_change)
        self._broadcast = broadcast
        self._member_name = member_name
        self._check_host = check_host
        self._check_port = check_port
        self._user_agent = user_agent
        self._wall = wall
        self._seq = 0
        self._last_sent: tuple[tuple[str, str, bool], ...] = ()
        self._last_sent_at = 0.0
        self._probe_now = asyncio.Event()

    # --- the view every rule reads ------------------------------------------------------------

    def view(self) -> ClusterView:
        regions = self.store.regions
        return self.quorum.view(regions=[n for n, r in regions.items() if not r.witness], members=self._members(),
                                fenced=self.store.fenced.keys(), observations=self.observations.values(),
                                witnesses=[n for n, r in regions.items() if r.witness], reports=self.reports,
                                region_reports=self.region_reports)

    def _on_store_change(self, changes: list[Entry]) -> None:
        for entry in changes:
            if entry.key[0] == Kind.COPY.value and entry.value is not None:
                writer, region = entry.version.writer, str(entry.key[-1])
                if entry.version.hlc > self.reports.get(writer, 0):
                    self.reports[writer] = entry.version.hlc
                if entry.version.hlc > self.region_reports.get(region, 0):
                    self.region_reports[region] = entry.version.hlc
        if changes and any(e.key[0] == Kind.COPY.value for e in changes):
            self._notify()   # a returning region's fresh reports may bring it back

    # --- incoming -----------------------------------------------------------------------------

    def user_message(self, message: User) -> bool:
        if not message.key.startswith(PREFIX):
            return False
        try:
            received = decode_observations(message.payload, self._wall(), book=self.book, is_member=self._is_member)
        except ObservationError as exc:
            self.metrics.received.labels("refused").inc()
            logger.debug("observation from %s refused: %s", message.origin, exc)
            return True
        if received and received[0].observer == self.region:
            return True   # another agent of this region: it sees what we see, and we say it ourselves
        self.metrics.received.labels("ok").inc()
        if self._keep(received):
            self._notify()
        return True

    def _is_member(self, agent: str, region: str) -> bool:
        return any(v.member.name == agent and v.member.region == region and v.state in (State.ALIVE, State.SUSPECT)
                   for v in self._members())

    def _keep(self, observations: Sequence[Observation]) -> bool:
        changed = False
        for obs in observations:
            key = (obs.aspect, obs.observer, obs.subject)
            current = self.observations.get(key)
            if current is not None and current.observed_at >= obs.observed_at:
                continue
            if current is None and len(self.observations) >= MAX_OBSERVATIONS:
                self._drop_oldest()
            changed = changed or current is None or current.up != obs.up
            self.observations[key] = obs
        return changed

    def _drop_oldest(self) -> None:
        oldest = min(self.observations, key=lambda k: self.observations[k].observed_at)
        del self.observations[oldest]

    def _notify(self) -> None:
        for listener in list(self.listeners):
            listener()

    # --- outgoing -----------------------------------------------------------------------------

    def own_observations(self) -> list[Observation]:
        now = self._wall()
        own = liveness_observations(self.view())
        own += [Observation(Aspect.INGRESS, self.region, subject, up, now)
                for subject, up in sorted(self.ingress.items()) if subject in self.store.regions]
        return own

    def is_publisher(self) -> bool:
        """One agent speaks for its region: the lowest member name of the region alive in this view.

        The region's agents see the same network, and observations count one vote per region, so
        N agents per region cost the cluster one region's broadcasts, not N (each broadcast is
        relayed by every member: at 20 agents in 5 regions every agent publishing was ~4.5 kB/s
        per agent of idle gossip).
        """
        names = [v.member.name for v in self._members()
                 if v.member.region == self.region and v.state in (State.ALIVE, State.SUSPECT)]
        return min([*names, self._member_name]) == self._member_name

    def publish(self, *, force: bool = False) -> bool:
        """Gossip this region's observations when they changed, or when the last ones are getting old."""
        own = self.own_observations()
        signature = tuple((o.aspect.value, o.subject, o.up) for o in own)
        now = self._wall()
        refresh = now - self._last_sent_at >= self.settings.observation_max_age / 3
        changed = self._keep(own)
        if not own or not self.is_publisher() or (signature == self._last_sent and not refresh and not force):
            if changed:
                self._notify()
            return False
        for payload in encode_observations(self.region, own, agent=self._member_name,
                                           signer=None if self.signer is None else self.signer()):
            self._seq += 1
            self._broadcast(f"{PREFIX}{self._member_name}:{self._seq}", payload)
            self.metrics.published.inc()
        self._last_sent, self._last_sent_at = signature, now
        if changed:
            self._notify()
        return True

    async def run_publish(self) -> None:
        while True:
            self.publish()
            await asyncio.sleep(self.settings.observe_interval)

    # --- ingress probes -----------------------------------------------------------------------

    async def run_ingress(self) -> None:
        session = new_session()
        try:
            while True:
                started = time.monotonic()
                self._probe_now.clear()
                await self.probe_round(session)
                # A probe that disagrees with the verdict is confirmed a re-check delay later, not an interval.
                wait = min(self._next_probe, self.settings.ingress_interval - (time.monotonic() - started))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._probe_now.wait(), max(0.0, wait))
        finally:
            await session.close()

    def probe_soon(self) -> None:
        """Probe every region now (a member came back: its region's old "ingress down" votes must not
        outlive the partition that caused them by a whole interval)."""
        self._probe_now.set()

    async def probe_round(self, session: aiohttp.ClientSession) -> None:
        regions = {name: r.ipv4 + r.ipv6 for name, r in self.store.regions.items()
                   if name != self.region and r.ipv4 + r.ipv6}
        results = await asyncio.gather(*(self._probe_region(session, name, addresses)
                                         for name, addresses in regions.items()))
        changed = False
        self._next_probe = self.settings.ingress_interval
        for name, result in zip(regions, results, strict=True):
            if result is None:
                continue   # no probe could be made here: no evidence either way
            up, detail = result
            state = self._probed.setdefault(name, TargetState())
            self._next_probe = min(self._next_probe, state.observe(up, detail, self._rule))
            if state.health is TargetHealth.UNKNOWN:
                continue   # a first failure, not yet confirmed: no vote
            verdict = state.health is TargetHealth.UP
            if self.ingress.get(name) == verdict:
                continue
            if name in self.ingress:
                logger.warning("region %s ingress %s as probed from %s: %s", name, "up" if verdict else "down",
                               self.region, detail[:300])
            changed = True
            self.ingress[name] = verdict
            self.metrics.ingress_up.labels(name).set(1 if verdict else 0)
        for gone in set(self.ingress) - set(regions):
            del self.ingress[gone]
            self.metrics.ingress_up.remove(gone)
        for gone in set(self._probed) - set(regions):
            del self._probed[gone]
        if changed:
            self.publish(force=True)

    async def _probe_region(self, session: aiohttp.ClientSession, name: str,
                            addresses: tuple[str, ...]) -> tuple[bool, str] | None:
        """(up when any address answers, what the probes said); None when no probe could be made here."""
        host = self._check_host if self._check_port == 80 else f"{self._check_host}:{self._check_port}"
        results = await asyncio.gather(*(
            probe(session, CheckTarget(address, self._check_port, host, self.settings.ingress_path),
                  timeout=self.settings.ingress_timeout, expect="", user_agent=self._user_agent)
            for address in addresses))
        for result in results:
            self.metrics.probes.labels(result.outcome.value).inc()
        evidence = [r for r in results if r.outcome is not Outcome.LOCAL_ERROR]
        if not evidence:
            return None
        return any(r.ok for r in evidence), "; ".join(r.detail for r in evidence)
