"""This agent's part of a gossip cluster, built and wired in one place.

:class:`ClusterParts` binds the gossip port (a port in use, a bad keyring or bad TLS files stop
the agent with :class:`~region_agent.app.settings.SettingsError` naming the setting), then wires:

- the store replica (``s:`` broadcasts and anti-entropy of the replicated store),
- the observer (liveness from the membership, ingress probes of the other regions, ``o:``
  observation broadcasts) and the verdicts it feeds (:class:`~region_agent.cluster.answers.ClusterAnswers`,
  laid over the answers),
- the write gate the control API asks,
- the keyring file watcher and, with mutual TLS, the certificate files watcher.

:meth:`runners` are the loops the supervisor runs; the rest are views of the cluster for the
region view, the control API and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from region_agent.app.replication import StoreReplica
from region_agent.app.settings import AgentSettings, SettingsError
from region_agent.cluster.answers import ClusterAnswers
from region_agent.cluster.members import LIVE_STATES, MemberRow, member_rows
from region_agent.cluster.observer import ClusterObserver
from region_agent.cluster.quorum import Policy, Quorum
from region_agent.cluster.write_gate import WriteGate
from region_agent.gossip.keyfile import KeyringWatcher, load_keyring
from region_agent.gossip.membership import Membership, MemberView
from region_agent.gossip.messages import Role, State
from region_agent.gossip.metrics import register
from region_agent.gossip.node import GossipNode
from region_agent.gossip.sync import AntiEntropy
from region_agent.state.observations import Observations
from region_agent.state.store import Store

if TYPE_CHECKING:
    from region_agent.gossip.tls import GossipTls

Runner = Callable[[], Coroutine[Any, Any, None]]


class ClusterParts:
    def __init__(self, settings: AgentSettings, *, store: Store, observations: Observations,
                 registry: CollectorRegistry, user_agent: str) -> None:
        self.settings = settings
        self.store = store
        self.observations = observations
        self.registry = registry
        self.user_agent = user_agent
        self.quorum = Quorum(local_region=settings.region, max_age=settings.cluster.observation_max_age,
                             clock=time.time)
        self.view_listeners: list[Callable[[], None]] = []   # membership or verdicts changed
        self.tls: GossipTls | None = None

    async def start(self) -> None:
        """Bind the gossip port and wire everything; joining and syncing run in :meth:`runners`."""
        g = self.settings.gossip
        assert g.keyring_file is not None  # the settings require it
        try:
            keyring = load_keyring(g.keyring_file)
        except (ValueError, OSError) as exc:
            raise SettingsError(f"gossip.keyring_file: {exc}") from exc
        if g.tls_ca_file is not None and g.tls_cert_file is not None and g.tls_key_file is not None:
            from region_agent.gossip.tls import GossipTls

            try:
                self.tls = GossipTls.from_files(g.tls_ca_file, g.tls_cert_file, g.tls_key_file)
            except (ValueError, OSError) as exc:
                raise SettingsError(f"gossip.tls_*: {exc}") from exc
        self.replica = StoreReplica(self.store, self.registry)
        role = Role.WITNESS if self.settings.cluster.role == "witness" else Role.AGENT
        node = self.node = GossipNode(g, region=self.settings.region, node=self.settings.node, keyring=keyring,
                                      replica=self.replica, tls=self.tls, role=role)
        try:
            await node.start()
        except OSError as exc:
            raise SettingsError(f"gossip.port: can not listen on {g.bind_address} port {g.port}: "
                                f"{exc.strerror or exc}") from exc
        assert node.membership is not None and node.anti_entropy is not None  # start() made them
        self.membership: Membership = node.membership
        self.anti_entropy: AntiEntropy = node.anti_entropy
        self.keyring_watcher = KeyringWatcher(g.keyring_file, keyring)
        register(node, self.registry, self.keyring_watcher)
        c, checks = self.settings.cluster, self.settings.checks
        self.observer = ClusterObserver(
            region=self.settings.region, settings=c, quorum=self.quorum, store=self.store, members=node.members,
            broadcast=node.broadcast, member_name=node.name, check_host=checks.host, check_port=checks.port,
            user_agent=f"{self.user_agent} ingress-probe", registry=self.registry)
        self.answers = ClusterAnswers(store=self.store, observations=self.observations, view=self.observer.view,
                                      policy=Policy(c.two_region_policy), registry=self.registry)
        self.write_gate = WriteGate(self.observer.view, self.membership, asyncio.get_running_loop().time)
        self.observer.listeners.append(self.answers.request)
        self.answers.listeners.append(self._view_changed)
        node.user_handlers.append(self.replica.user_message)
        node.user_handlers.append(self.observer.user_message)
        self.replica.attach(node.broadcast, node.sync_now, node.queued_broadcasts)
        node.member_listeners.append(self._on_member_change)

    def runners(self) -> dict[str, Runner]:
        runners: dict[str, Runner] = {
            "gossip join": self.node.run_join,
            "gossip anti-entropy": self.node.run_anti_entropy,
            "gossip keyring": self.keyring_watcher.run,
        }
        if self.tls is not None:
            runners["gossip tls"] = self.tls.run   # re-reads rotated certificate files
        runners["cluster observations"] = self.observer.run_publish
        runners["cluster ingress probes"] = self.observer.run_ingress
        runners["cluster verdicts"] = self.answers.run
        return runners

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.node.stop()

    async def synced(self, timeout: float) -> None:
        """Wait for a first exchange with a peer, at most ``timeout`` (a lone first agent comes up after it)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.anti_entropy.synced.wait(), timeout)

    def _on_member_change(self, view: MemberView, previous: State | None) -> None:
        if view.state is State.ALIVE and previous is not State.ALIVE and previous is not State.SUSPECT:
            self.observer.probe_soon()   # a member (re)appeared: look at its region's ingress now
        self.answers.request()
        self._view_changed()

    def _view_changed(self) -> None:
        for listener in self.view_listeners:
            listener()

    # --- views ---------------------------------------------------------------------------------

    def problems(self) -> tuple[str, ...]:
        return self.keyring_watcher.problems() + (() if self.tls is None else self.tls.problems())

    def member_rows(self) -> list[MemberRow]:
        """The members as rows, ``since`` as wall time (the control API shows them to people)."""
        return member_rows(self.node.members(), since_wall=self.node.since_wall, rtt=self.membership.rtt.get)

    def members_by_region(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for view in self.node.members():
            if view.state in LIVE_STATES:
                counts[view.member.region] = counts.get(view.member.region, 0) + 1
        return counts

    def peer_digests(self) -> dict[str, str | None]:
        """Every other live member's store digest as last heard by anti-entropy (None: not heard yet)."""
        heard = self.anti_entropy.peer_digests
        return {view.member.name: (heard[view.member.name].digest if view.member.name in heard else None)
                for view in self.node.members()
                if view.member.name != self.node.name and view.state in LIVE_STATES}

    def announce(self, key: str, value: str) -> None:
        """Set one key of this agent's member metadata (a new incarnation only when it changes)."""
        self.membership.update_meta({**self.membership.local.metadata, key: value})
