from __future__ import annotations

import pytest

from region_agent.base.names import InvalidNameError
from region_agent.base.request_ids import RequestIds, is_valid_request_id

VALID = "req_lax1-1700000000000-0123456789ab"


@pytest.mark.parametrize(
    ("incoming", "valid"),
    [
        (VALID, True),
        ("req_sfo12-1-abcdefabcdef", True),
        ("req_LAX1-1700000000000-0123456789ab", False),  # upper-case region
        ("req_la1-1700000000000-0123456789ab", False),  # not an IATA code
        ("req_lax1-1700000000000-0123456789AB", False),  # upper-case hex
        ("req_lax1-1700000000000-0123456789a", False),  # 11 hex
        ("req_lax1-17000000000000000-0123456789ab", False),  # 17 digits of ms
        ("req_lax1-now-0123456789ab", False),
        (VALID + "\r\nX-Evil: 1", False),  # header injection
        (VALID + " ", False),
        ("", False),
        ("x" * 10_000, False),
    ],
)
def test_validity(incoming: str, valid: bool) -> None:
    assert is_valid_request_id(incoming) is valid


def test_a_valid_incoming_id_is_kept_even_from_another_region() -> None:
    assert RequestIds("sfo1").accept(VALID) == VALID


@pytest.mark.parametrize("incoming", [None, "", "abc", VALID.upper(), VALID + "\n"])
def test_anything_else_is_replaced_by_a_new_id(incoming: str | None) -> None:
    ids = RequestIds("sfo1", wall=lambda: 1_700_000_000.1234, seed=1)
    new = ids.accept(incoming)
    assert new != incoming
    assert new.startswith("req_sfo1-1700000000123-")
    assert is_valid_request_id(new)


def test_generated_ids_are_well_formed_and_distinct() -> None:
    ids = RequestIds("ams1")
    made = {ids.new() for _ in range(1000)}
    assert len(made) == 1000
    assert all(is_valid_request_id(i) and i.startswith("req_ams1-") for i in made)


def test_bad_region_is_rejected_at_construction() -> None:
    with pytest.raises(InvalidNameError):
        RequestIds("SFO")
