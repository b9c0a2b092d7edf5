"""Observations on the wire, ingress probes against real loopback endpoints, verdicts laid over answers."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import CollectorRegistry

from region_agent.checks.probe import new_session
from region_agent.cluster.answers import ClusterAnswers
from region_agent.cluster.observer import (
    ClusterObserver,
    ObservationError,
    decode_observations,
    encode_observations,
)
from region_agent.cluster.quorum import Aspect, Observation, Policy, Quorum, Status
from region_agent.cluster.settings import ClusterSettings
from region_agent.demo.fake_copy import HealthEndpoint
from region_agent.gossip.membership import MemberView
from region_agent.gossip.messages import MAX_USER_PAYLOAD, Address, Member, Role, State, User
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, PartitionPolicy, Project, Region, project_key, region_key
from region_agent.state.observations import Observations, ObservedState
from region_agent.state.store import Store
from tests.fakes.identities import ClusterCA

NOW = 1_800_000_000.0


def _member(region: str, node: str, state: State = State.ALIVE, role: Role = Role.AGENT) -> MemberView:
    return MemberView(Member(f"{region}/{node}", region, node, role, Address("127.0.0.1", 7946)), state, 0.0)


def _store(*regions: str, projects: dict[str, tuple[str, ...]] | None = None) -> Store:
    store = Store(writer="control/test", clock=HybridClock(lambda: int(time.time() * 1000)))
    items: list[tuple[tuple[str, ...], Region | Project]] = [
        (region_key(r), Region(r, ipv4=(f"127.0.0.{41 + i}",))) for i, r in enumerate(regions)]
    items += [(project_key(s), Project(s, where)) for s, where in (projects or {}).items()]
    store.put_many(items)
    return store


def test_observations_round_trip_in_payloads_that_fit_a_datagram() -> None:
    many = [Observation(Aspect.INGRESS, "sfo1", f"r{i:02d}x{i}"[:3] + str(i), i % 2 == 0, NOW) for i in range(200)]
    many = [Observation(o.aspect, o.observer, f"abc{i}", o.up, o.observed_at) for i, o in enumerate(many)]
    payloads = encode_observations("sfo1", many, agent="sfo1/n1")
    assert len(payloads) > 1 and all(len(p) <= MAX_USER_PAYLOAD for p in payloads)
    decoded = [o for p in payloads for o in decode_observations(p, NOW)]
    assert [(o.subject, o.up) for o in decoded] == [(o.subject, o.up) for o in many]
    assert all(abs(o.observed_at - NOW) < 0.001 for o in decoded)


@pytest.mark.parametrize(("payload", "problem"), [
    (encode_observations("sfo1", [Observation(Aspect.LIVENESS, "sfo1", "ams1", False, NOW)], agent="ams1/n1"),
     "may not speak for region"),
    (encode_observations("sfo1", [Observation(Aspect.LIVENESS, "sfo1", "ams1", False, NOW + 3600)],
                         agent="sfo1/n1"), "in the future"),
    ([json.dumps({"v": 2, "r": "sfo1", "a": "sfo1/n1", "o": [["x", "ams1", 0, 1]]}).encode()], "bad observation row"),
    ([json.dumps({"v": 2, "r": "sfo1", "a": "sfo1/n1", "o": [["l", "NOT A REGION", 0, 1]]}).encode()], None),
    ([json.dumps({"v": 1, "r": "sfo1", "o": []}).encode()], "version 2"),
    ([b"\xff\x00"], None),
])
def test_bad_observation_messages_are_refused(payload: list[bytes], problem: str | None) -> None:
    with pytest.raises(ObservationError, match=problem):
        decode_observations(payload[0], NOW)


def test_signed_observations_speak_only_for_a_live_member_of_their_region() -> None:
    """The insiders: a keyring holder without a certificate, an agent of another region with one, and an agent
    with a valid certificate that is not (or no longer) a member."""
    ca = ClusterCA.make()
    ams, sfo = ca.agent("ams1", "n1"), ca.agent("sfo1", "n1")
    book = ca.book()
    for agent in (ams, sfo):
        book.add(agent.der)
    live = {"ams1/n1"}

    def decode(payload: bytes) -> list[Observation]:
        return decode_observations(payload, NOW, book=book, is_member=lambda agent, _region: agent in live)

    down = [Observation(Aspect.INGRESS, "ams1", "fra1", False, NOW)]
    good = encode_observations("ams1", down, agent="ams1/n1", signer=ams.signer)[0]
    assert [(o.observer, o.subject, o.up) for o in decode(good)] == [("ams1", "fra1", False)]
    unsigned = encode_observations("ams1", down, agent="ams1/n1")[0]
    with pytest.raises(ObservationError):
        decode(unsigned)
    # San Francisco's agent signing in Amsterdam's name.
    with pytest.raises(ObservationError, match="may not speak for agent"):
        decode(encode_observations("ams1", down, agent="ams1/n1", signer=sfo.signer)[0])
    # A body changed after signing.
    tampered = json.loads(good)
    tampered["b"] = tampered["b"].replace('0,', '1,', 1)
    with pytest.raises(ObservationError, match="does not verify"):
        decode(json.dumps(tampered).encode())
    # A certificate under another CA.
    rogue = ClusterCA.make("rogue").agent("ams1", "n1")
    with pytest.raises(ObservationError, match="unknown certificate"):
        decode(encode_observations("ams1", down, agent="ams1/n1", signer=rogue.signer)[0])
    # Valid, but the agent left: it votes no more.
    live.clear()
    with pytest.raises(ObservationError, match="not a live member"):
        decode(good)


def _observer(store: Store, members: list[MemberView], sent: list[tuple[str, bytes]], *,
              port: int = 1) -> ClusterObserver:
    settings = ClusterSettings(ingress_timeout=0.5, ingress_interval=1.0)
    return ClusterObserver(region="sfo1", settings=settings, quorum=Quorum(local_region="sfo1", max_age=30,
                                                                           clock=time.time),
                           store=store, members=lambda: members, broadcast=lambda k, p: sent.append((k, p)),
                           member_name="sfo1/n1", check_host="runr-health.g.example.com", check_port=port,
                           user_agent="test", registry=CollectorRegistry())


async def test_ingress_is_probed_once_per_region_address_and_published_when_it_changes() -> None:
    """Votes follow the copy checks' rule: down after ``fall`` failed probes in a row, up after ``rise``."""
    store = _store("sfo1", "ams1", "fra1", projects={f"p{i}": ("sfo1", "ams1", "fra1") for i in range(500)})
    ams1 = HealthEndpoint("127.0.0.42")
    port = await ams1.start()
    fra1 = HealthEndpoint("127.0.0.43", port)
    await fra1.start()
    sent: list[tuple[str, bytes]] = []
    members = [_member("sfo1", "n1"), _member("ams1", "n1"), _member("fra1", "n1")]
    observer = _observer(store, members, sent, port=port)
    session = new_session()
    try:
        since = time.time()
        await observer.probe_round(session)
        assert observer.ingress == {"ams1": True, "fra1": True}
        # 500 projects, two other regions of one address each: two probes, not 1,000.
        assert len(ams1.checks_since(since - 1)) + len(fra1.checks_since(since - 1)) == 2
        assert len(sent) == 1
        fra1.ingress_up = False
        await observer.probe_round(session)
        # One failed probe is no vote (it was, and 5 % loss made 33 in 300 s): it is re-checked soon.
        assert observer.ingress == {"ams1": True, "fra1": True} and len(sent) == 1
        assert observer._next_probe == observer._rule.recheck_delay
        await observer.probe_round(session)   # the second failure in a row: down (the copy checks' fall)
        assert observer.ingress == {"ams1": True, "fra1": False}
        assert observer._next_probe == observer._rule.interval
        payload = decode_observations(sent[-1][1], time.time())
        assert {(o.aspect, o.subject, o.up) for o in payload} >= {(Aspect.INGRESS, "fra1", False)}
        await observer.probe_round(session)   # nothing changed: nothing sent
        assert len(sent) == 2
        fra1.ingress_up = True                 # back: up after ``rise`` good probes, not one
        await observer.probe_round(session)
        assert observer.ingress == {"ams1": True, "fra1": False}
        await observer.probe_round(session)
        assert observer.ingress == {"ams1": True, "fra1": True} and len(sent) == 3
        for up in (False, True, False, True):  # a flapping, lossy path: single failures never vote
            fra1.ingress_up = up
            await observer.probe_round(session)
            assert observer.ingress["fra1"] is True
    finally:
        await session.close()
        await ams1.stop()
        await fra1.stop()


def test_observations_from_another_region_are_kept_and_our_own_region_is_ours_to_say() -> None:
    store = _store("sfo1", "ams1", "fra1")
    observer = _observer(store, [_member("sfo1", "n1"), _member("ams1", "n1")], [])
    heard: list[int] = []
    observer.listeners.append(lambda: heard.append(1))
    payload = encode_observations("ams1", [Observation(Aspect.INGRESS, "ams1", "fra1", False, time.time())],
                                  agent="ams1/n1")[0]
    assert observer.user_message(User("o:ams1/n1:1", "ams1/n1", payload))
    assert observer.observations[(Aspect.INGRESS, "ams1", "fra1")].up is False and heard == [1]
    own = encode_observations("sfo1", [Observation(Aspect.INGRESS, "sfo1", "fra1", True, time.time())],
                              agent="sfo1/n1")[0]
    assert observer.user_message(User("o:sfo1/n2:1", "sfo1/n2", own))
    assert (Aspect.INGRESS, "sfo1", "fra1") not in observer.observations
    assert not observer.user_message(User("s:abc", "ams1/n1", b"{}"))   # not an observation: another handler's


async def test_a_region_out_by_majority_leaves_the_answers_and_comes_back() -> None:
    store = _store("sfo1", "ams1", "fra1", projects={"shop": ("sfo1", "ams1", "fra1"), "blog": ("ams1",)})
    for slug, region in (("shop", "sfo1"), ("shop", "ams1"), ("shop", "fra1"), ("blog", "ams1")):
        store.put_many([(("copy", slug, region), CopyHealth(True))], writer=f"{region}/n1")
    observations = Observations()
    members = [_member("sfo1", "n1"), _member("ams1", "n1"), _member("fra1", "n1")]
    votes: list[Observation] = []
    quorum = Quorum(local_region="sfo1", max_age=30, clock=time.time)

    def view():  # type: ignore[no-untyped-def]
        return quorum.view(regions=store.regions.keys(), members=members, fenced=store.fenced.keys(),
                           observations=votes)

    answers = ClusterAnswers(store=store, observations=observations, view=view, policy=Policy.HOLD,
                             registry=CollectorRegistry())
    answers.recompute()
    assert answers.out == {} and answers.majority
    # fra1's agents die: sfo1's own view is one vote of two; ams1 has not said so yet.
    members[2] = _member("fra1", "n1", State.DEAD)
    answers.recompute()
    assert answers.out == {}
    votes.append(Observation(Aspect.LIVENESS, "ams1", "fra1", False, time.time()))
    answers.recompute()
    assert set(answers.out) == {"fra1"}
    combined = ObservedState(store, observations).copies
    assert combined[("shop", "fra1")].healthy is False and combined[("shop", "ams1")].healthy is True
    # ams1's ingress is seen down by sfo1 only (fra1 is not a live vantage point): one vote of one is
    # no quorum (an agent being cut off sees just this), the policy decides: hold keeps ams1.
    votes.append(Observation(Aspect.INGRESS, "sfo1", "ams1", False, time.time()))
    answers.recompute()
    assert set(answers.out) == {"fra1"} and answers.verdicts["ams1"].status is Status.CONTESTED
    assert ObservedState(store, observations).copies[("blog", "ams1")].healthy is True
    # fra1 is back: it is a vantage point again, and ams1's ingress is down for one of two: back in.
    members[2] = _member("fra1", "n1")
    answers.recompute()
    assert answers.out == {}
    assert observations.copies == {}


def test_one_agent_per_region_publishes_the_lowest_name_alive() -> None:
    store = _store("sfo1", "ams1")
    sent: list[tuple[str, bytes]] = []
    members = [_member("sfo1", "n0"), _member("sfo1", "n1"), _member("ams1", "n1")]
    observer = _observer(store, members, sent)   # it is sfo1/n1
    assert not observer.is_publisher() and not observer.publish(force=True) and sent == []
    assert (Aspect.LIVENESS, "sfo1", "ams1") in observer.observations   # kept for its own view all the same
    members[0] = _member("sfo1", "n0", State.DEAD)
    assert observer.is_publisher() and observer.publish() and len(sent) == 1


async def test_a_contested_region_is_dropped_only_by_projects_whose_policy_says_failover() -> None:
    store = _store("sfo1", "ams1")
    store.put_many([(project_key("keep"), Project("keep", ("sfo1", "ams1"))),
                    (project_key("drop"), Project("drop", ("sfo1", "ams1"), partition=PartitionPolicy.FAILOVER))],
                   writer="control/api")
    members = [_member("sfo1", "n1"), _member("ams1", "n1", State.DEAD)]
    quorum = Quorum(local_region="sfo1", max_age=30, clock=time.time)
    observations = Observations()
    answers = ClusterAnswers(store=store, observations=observations,
                             view=lambda: quorum.view(regions=store.regions.keys(), members=members),
                             policy=Policy.HOLD, registry=CollectorRegistry())
    answers.recompute()
    assert answers.verdicts["ams1"].status.value == "contested" and answers.out == {}   # the zone holds
    assert set(observations.copies) == {("drop", "ams1")}
    # The project changes its policy back: its copy returns without any membership change.
    store.put_many([(project_key("drop"), Project("drop", ("sfo1", "ams1")))], writer="control/api")
    assert observations.copies == {}
