"""Names shared by every component, validated in one place.

A region name is an IATA code plus a number (``sfo1``); the same string appears in DNS
names, metric labels, logs, request ids and Kubernetes labels, so it must be safe in all
of them. A project slug is one DNS label.
"""

from __future__ import annotations

import re
from typing import NewType

RegionName = NewType("RegionName", str)
ProjectSlug = NewType("ProjectSlug", str)

REGION_PATTERN = re.compile(r"^[a-z]{3}[0-9]+$")
# ns-<region> is one DNS label (RFC 1035 §2.3.4: at most 63 octets), and a Kubernetes label value too.
MAX_REGION_NAME = 60
# One DNS label (RFC 1035 §2.3.1 letters-digits-hyphen, lower case, at most 63 octets).
SLUG_PATTERN = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


class InvalidNameError(ValueError):
    """A region name or slug that does not follow the naming rules."""


def region_name(value: str) -> RegionName:
    if not REGION_PATTERN.fullmatch(value):
        raise InvalidNameError(f"region name {value!r} must match {REGION_PATTERN.pattern} (e.g. sfo1)")
    if len(value) > MAX_REGION_NAME:
        raise InvalidNameError(f"region name {value[:16]}... is {len(value)} characters, at most {MAX_REGION_NAME} "
                               "(ns-<region> is one DNS label of at most 63 octets)")
    return RegionName(value)


def project_slug(value: str) -> ProjectSlug:
    if not SLUG_PATTERN.fullmatch(value):
        raise InvalidNameError(
            f"project slug {value!r} must be one lower-case DNS label: letters, digits and '-', "
            "not starting or ending with '-', at most 63 characters"
        )
    return ProjectSlug(value)

