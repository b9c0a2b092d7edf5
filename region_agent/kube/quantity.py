"""Kubernetes resource quantities ("250m", "1.5", "128Mi", "1e3") as exact decimals.

Pure, table-tested. Usage metering sums pod requests, so the parse must be exact (Decimal, not
float) and must reject garbage instead of guessing.
"""

from __future__ import annotations

import functools
import math
import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, Decimal] = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$")


class QuantityError(ValueError):
    """Not a Kubernetes quantity."""


def parse_quantity(value: str | int | float) -> Decimal:
    """``"250m"`` → ``Decimal("0.250")``; ``"1Gi"`` → ``Decimal(1073741824)``."""
    if isinstance(value, bool):
        raise QuantityError(f"not a quantity: {value!r}")
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    return _parse_text(value)


@functools.lru_cache(maxsize=4096)
def _parse_text(value: str) -> Decimal:
    # The pods of one node repeat a handful of strings ("500m", "256Mi"): parse each once.
    match = _QUANTITY.fullmatch(value.strip())
    if not match:
        raise QuantityError(f"not a quantity: {value!r}")
    number, exponent, suffix = match.groups()
    try:
        result = Decimal(number)
        if exponent:
            result = result * (Decimal(10) ** int(exponent[1:]))
    except (InvalidOperation, ValueError) as error:
        raise QuantityError(f"not a quantity: {value!r}") from error
    return result * _SUFFIXES[suffix or ""]


def millicores(value: str | int | float) -> int:
    """CPU in millicores, rounded up as the kubelet does ("250m" → 250, "0.1" → 100, "1" → 1000).

    Billing multiplies sizes by seconds, so sizes are integers: no float rounding can make two
    agents, or two retries, disagree about a record.
    """
    return math.ceil(parse_quantity(value) * 1000)


def whole_units(value: str | int | float) -> int:
    """Bytes or devices, rounded up ("1Gi" → 1073741824, "1" → 1)."""
    return math.ceil(parse_quantity(value))
