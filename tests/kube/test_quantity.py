from __future__ import annotations

from decimal import Decimal

import pytest

from region_agent.kube.quantity import QuantityError, parse_quantity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("250m", Decimal("0.25")),
        ("1", Decimal(1)),
        ("0.5", Decimal("0.5")),
        (".5", Decimal("0.5")),
        ("2", Decimal(2)),
        ("128Mi", Decimal(128 * 2**20)),
        ("1Gi", Decimal(2**30)),
        ("1G", Decimal(10**9)),
        ("2k", Decimal(2000)),
        ("1e3", Decimal(1000)),
        ("1E3", Decimal(1000)),
        ("1E", Decimal(10**18)),
        ("100n", Decimal("1e-7")),
        ("1.5Gi", Decimal(3 * 2**29)),
        (3, Decimal(3)),
        (0.25, Decimal("0.25")),
    ],
)
def test_parse(text: str | int | float, expected: Decimal) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "1Mb", "1.2.3", "--1", "1 Gi", "Gi"])
def test_rejects_garbage(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


def test_rejects_booleans() -> None:
    with pytest.raises(QuantityError):
        parse_quantity(True)
