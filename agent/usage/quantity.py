"""Kubernetes resource quantities ("250m", "1.5Gi", "1e3") as exact integers.

Billing multiplies sizes by seconds, so sizes are kept as integers (millicores, bytes, whole
devices) parsed with :class:`~decimal.Decimal`: no float rounding can make two agents, or two
retries, disagree about a record. Fractions below the unit are rounded up, as the kubelet does
when it turns a request into cgroup values.
"""

from __future__ import annotations

import functools
import math
import re
from decimal import Decimal, InvalidOperation

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")

_SUFFIX: dict[str, Decimal] = {
    "": Decimal(1),
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity."""


def parse_quantity(text: str | int | float) -> Decimal:
    """The exact value of a quantity in base units (cores, bytes, devices)."""
    if isinstance(text, int | float):
        return Decimal(str(text))
    return _parse_text(text)


@functools.lru_cache(maxsize=4096)
def _parse_text(text: str) -> Decimal:
    # Pods of one node repeat a handful of strings ("500m", "256Mi"): parse each once.
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        raise QuantityError(f"not a Kubernetes quantity: {text!r}")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        value = Decimal(number)
    except InvalidOperation as exc:
        raise QuantityError(f"not a Kubernetes quantity: {text!r}") from exc
    if suffix[:1] in ("e", "E"):
        return value.scaleb(int(suffix[1:]))
    return value * _SUFFIX[suffix]


def millicores(text: str | int | float) -> int:
    """CPU quantity in millicores, rounded up ("250m" → 250, "0.1" → 100, "1" → 1000)."""
    return math.ceil(parse_quantity(text) * 1000)


def whole_units(text: str | int | float) -> int:
    """Bytes or devices, rounded up ("1Gi" → 1073741824, "1" → 1)."""
    return math.ceil(parse_quantity(text))
