"""The up/down rule with the quick re-check, as a table of result sequences."""

from __future__ import annotations

import pytest

from region_agent.checks.rule import CheckRule, TargetHealth, TargetState

RULE = CheckRule(interval=5.0, recheck_delay=0.1, fall=2, rise=2)
U, D, X = TargetHealth.UP, TargetHealth.DOWN, TargetHealth.UNKNOWN

CASES = [
    # results, health after each, delay after each
    ("first success is up at once", [True], [U], [5.0]),
    ("first failure is re-checked quickly", [False], [X], [0.1]),
    ("two failures at start: down", [False, False], [X, D], [0.1, 5.0]),
    ("a lost check does not flip", [True, False, True], [U, U, U], [5.0, 0.1, 5.0]),
    ("two failures flip, confirmed quickly", [True, False, False], [U, U, D], [5.0, 0.1, 5.0]),
    ("one success does not bring it back", [True, False, False, True], [U, U, D, D], [5.0, 0.1, 5.0, 0.1]),
    ("two successes do", [True, False, False, True, True], [U, U, D, D, U], [5.0, 0.1, 5.0, 0.1, 5.0]),
    ("a failure between successes resets rise", [False, False, True, False, True, True],
     [X, D, D, D, D, U], [0.1, 5.0, 0.1, 5.0, 0.1, 5.0]),
]


@pytest.mark.parametrize(("case", "results", "health", "delays"), CASES, ids=[c[0] for c in CASES])
def test_rule(case: str, results: list[bool], health: list[TargetHealth], delays: list[float]) -> None:
    state = TargetState()
    seen_health, seen_delay = [], []
    for ok in results:
        seen_delay.append(state.observe(ok, "ok" if ok else "http 503", RULE))
        seen_health.append(state.health)
    assert seen_health == health
    assert seen_delay == delays


def test_fall_and_rise_of_one_behave_like_powerdns() -> None:
    rule = CheckRule(interval=5.0, recheck_delay=0.1, fall=1, rise=1)
    state = TargetState()
    assert state.observe(True, "ok", rule) == 5.0
    assert state.observe(False, "http 503", rule) == 5.0
    after_failure = state.health
    assert state.observe(True, "ok", rule) == 5.0
    assert (after_failure, state.health) == (TargetHealth.DOWN, TargetHealth.UP)
