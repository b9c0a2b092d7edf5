"""Control API request bodies → model records, or an :class:`ApiError` naming the field (pure).

Field names in errors are JSON paths into the request: ``$.regions[1]`` for the body,
``path.slug`` for a path parameter, ``header.Idempotency-Key`` for a header. Unknown
fields are refused (a typo must not silently become a default), and so is any value of
the wrong JSON type (``true`` is not a number, ``"1"`` is not a list).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Collection, Mapping
from typing import Any

from region_agent.base.names import InvalidNameError, project_slug, region_name
from region_agent.state.model import (
    AllDownPolicy,
    Fence,
    Mode,
    ModelError,
    PartitionPolicy,
    Project,
    Region,
    address_problem,
)

__all__ = ["MAX_JSON_DEPTH", "ApiError", "json_depth", "parse_body", "parse_fence", "parse_project", "parse_region",
           "path_region", "path_slug"]

MAX_ADDRESSES = 64  # per address list of a region
MAX_REGIONS = 64  # per project
# Our bodies nest two deep (an object of lists); the bound keeps json's recursion far from Python's limit.
MAX_JSON_DEPTH = 16


class ApiError(Exception):
    """A request the API refuses: its status, a message and the field at fault (None: the request)."""

    def __init__(self, status: int, message: str, field: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": self.message, "field": self.field}


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (an empty body is an empty object); nested deeper than
    :data:`MAX_JSON_DEPTH` or with a key given twice in one object is refused (400)."""
    if not raw.strip():
        return {}
    if json_depth(raw, stop_above=MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the body nests arrays or objects more than {MAX_JSON_DEPTH} deep", "$")
    try:
        data = json.loads(raw, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", "$") from None
    if not isinstance(data, dict):
        raise ApiError(422, f"the body must be a JSON object, not {_json_type(data)}", "$")
    return data


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


# A string, or an unterminated one to the end of the body: the closing quote is optional so that no match
# ever fails and is retried from the next quote (that was quadratic: 17 s for 64 KiB of "\" ...).
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes, *, stop_above: int | None = None) -> int:
    """How deep arrays and objects nest in ``raw``, counted without parsing (so without recursion):
    strings removed, then the brackets left; once past ``stop_above`` the count stops there.
    Malformed input gets some count; the parser refuses it."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for byte in brackets:
        if byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
            if stop_above is not None and deepest > stop_above:
                break
        else:
            depth -= 1
    return deepest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all different (json's default keeps the last silently)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ApiError(400, f"the key {key!r} is given twice in one object", "$")
        data[key] = value
    return data


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _only(data: Mapping[str, Any], allowed: Collection[str]) -> None:
    for key in data:
        if key not in allowed:
            raise ApiError(422, f"unknown field {key!r} (allowed: {', '.join(sorted(allowed))})", f"$.{key}")


def path_slug(value: str) -> str:
    try:
        return project_slug(value)
    except InvalidNameError as exc:
        raise ApiError(422, str(exc), "path.slug") from None


def path_region(value: str) -> str:
    try:
        return region_name(value)
    except InvalidNameError as exc:
        raise ApiError(422, str(exc), "path.name") from None


def _name_matches(data: Mapping[str, Any], key: str, expected: str) -> None:
    if key in data and data[key] != expected:
        raise ApiError(422, f"{key} {data[key]!r} in the body differs from {expected!r} in the path", f"$.{key}")


def _string(data: Mapping[str, Any], key: str, field: str) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise ApiError(422, f"{key} must be a string, not {_json_type(value)}", field)
    return value


def _enum(data: Mapping[str, Any], key: str, kind: type[Mode] | type[AllDownPolicy] | type[PartitionPolicy],
          default: str) -> str:
    if key not in data:
        return default
    value = _string(data, key, f"$.{key}")
    allowed = [member.value for member in kind]
    if value not in allowed:
        raise ApiError(422, f"{key} {value!r} is not one of {', '.join(allowed)}", f"$.{key}")
    return value


def parse_project(slug: str, data: Mapping[str, Any], known_regions: Collection[str]) -> Project:
    """A project from a PUT body; every region it names must be a known region. ``problems`` is what a
    GET adds (read-only, like a Kubernetes ``status``): accepted and ignored, so a body read can be
    written back."""
    _only(data, ("slug", "regions", "primary", "mode", "all_down", "partition", "problems"))
    _name_matches(data, "slug", slug)
    if "regions" not in data:
        raise ApiError(422, "regions is required", "$.regions")
    regions = data["regions"]
    if not isinstance(regions, list):
        raise ApiError(422, f"regions must be an array of region names, not {_json_type(regions)}", "$.regions")
    if not regions:
        raise ApiError(422, "regions must name at least one region", "$.regions")
    if len(regions) > MAX_REGIONS:
        raise ApiError(422, f"regions may name at most {MAX_REGIONS} regions", "$.regions")
    seen: set[str] = set()
    for index, name in enumerate(regions):
        field = f"$.regions[{index}]"
        if not isinstance(name, str):
            raise ApiError(422, f"a region name must be a string, not {_json_type(name)}", field)
        try:
            region_name(name)
        except InvalidNameError as exc:
            raise ApiError(422, str(exc), field) from None
        if name in seen:
            raise ApiError(422, f"region {name} is listed twice", field)
        if name not in known_regions:
            raise ApiError(422, f"region {name} is not a known region (PUT /v1/regions/{name} first)", field)
        seen.add(name)
    primary = data.get("primary")
    if primary is not None:
        primary = _string(data, "primary", "$.primary")
        if primary not in seen:
            raise ApiError(422, f"primary {primary!r} is not one of the project's regions", "$.primary")
    mode = _enum(data, "mode", Mode, Mode.HA.value)
    all_down = _enum(data, "all_down", AllDownPolicy, AllDownPolicy.ALL.value)
    partition = (None if data.get("partition") is None
                 else PartitionPolicy(_enum(data, "partition", PartitionPolicy, "")))
    try:
        return Project(slug, tuple(regions), primary, Mode(mode), AllDownPolicy(all_down), partition)
    except (ModelError, ValueError) as exc:  # the checks above should leave nothing to this
        raise ApiError(422, str(exc), "$") from None


_ADDRESS_FIELDS = (("ipv4", 4), ("ipv6", 6), ("ns_ipv4", 4), ("ns_ipv6", 6))


def parse_region(name: str, data: Mapping[str, Any]) -> Region:
    """A region from a PUT body: ingress and name-server addresses, location."""
    _only(data, ("name", *(key for key, _ in _ADDRESS_FIELDS), "latitude", "longitude", "witness"))
    _name_matches(data, "name", name)
    lists: dict[str, tuple[str, ...]] = {}
    for key, version in _ADDRESS_FIELDS:
        values = data.get(key, [])
        if values is None:
            values = []
        if not isinstance(values, list):
            raise ApiError(422, f"{key} must be an array of IPv{version} addresses, not {_json_type(values)}",
                           f"$.{key}")
        if len(values) > MAX_ADDRESSES:
            raise ApiError(422, f"{key} may hold at most {MAX_ADDRESSES} addresses", f"$.{key}")
        out = []
        for index, raw in enumerate(values):
            field = f"$.{key}[{index}]"
            if not isinstance(raw, str):
                raise ApiError(422, f"an address must be a string, not {_json_type(raw)}", field)
            try:
                address = ipaddress.ip_address(raw)
            except ValueError:
                raise ApiError(422, f"{raw!r} is not an IP address", field) from None
            if address.version != version:
                raise ApiError(422, f"{raw} is not an IPv{version} address", field)
            problem = address_problem(address)
            if problem is not None:
                raise ApiError(422, f"{raw} {problem}: {key} must be unicast addresses clients can reach", field)
            out.append(str(address))
        lists[key] = tuple(out)
    location: dict[str, float | None] = {}
    for key, bound in (("latitude", 90.0), ("longitude", 180.0)):
        value = data.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ApiError(422, f"{key} must be a number, not {_json_type(value)}", f"$.{key}")
            if not -bound <= value <= bound:
                raise ApiError(422, f"{key} {value} is outside -{bound:g}..{bound:g}", f"$.{key}")
            value = float(value)
        location[key] = value
    if (location["latitude"] is None) != (location["longitude"] is None):
        missing = "longitude" if location["longitude"] is None else "latitude"
        raise ApiError(422, "latitude and longitude go together", f"$.{missing}")
    witness = data.get("witness", False)
    if not isinstance(witness, bool):
        raise ApiError(422, f"witness must be true or false, not {_json_type(witness)}", "$.witness")
    try:
        return Region(name, lists["ipv4"], lists["ipv6"], lists["ns_ipv4"], lists["ns_ipv6"], location["latitude"],
                      location["longitude"], witness)
    except (ModelError, ValueError) as exc:
        raise ApiError(422, str(exc), "$") from None


def parse_fence(name: str, data: Mapping[str, Any]) -> Fence:
    _only(data, ("reason",))
    reason = _string(data, "reason", "$.reason") if data.get("reason") is not None else ""
    if len(reason) > 256:
        raise ApiError(422, "reason may be at most 256 characters", "$.reason")
    return Fence(name, reason)
