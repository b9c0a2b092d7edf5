"""The agent → sidecar feed's wire format: JSON lines, a snapshot then deltas. Pure.

One connection carries, in order: one ``snapshot`` (the full :class:`RegionView`), then a
``delta`` per change, and a ``heartbeat`` whenever nothing changed for a while::

    {"v":1,"type":"snapshot","seq":1,"view":{...every RegionView field, "copies":{slug: copy}}}
    {"v":1,"type":"delta","seq":2,"view":{...every field, "copies":{}},"bindings_changed":false,
     "upsert":{"shop":{...}},"remove":["old"]}
    {"v":1,"type":"heartbeat","seq":3}

Why deltas: with 10,000 copies a full view is ~1.3 MB of JSON, ~30 ms to encode in the
agent and ~20 ms to validate in the sidecar, during which the sidecar answers nothing.
A delta costs O(changed copies); the full view crosses only once per connection. Over one
stream connection nothing is lost or reordered, so a delta always applies to the view the
previous messages built; a new connection always starts with a snapshot.

Decoding validates everything with pydantic in strict mode straight into the frozen
records of :mod:`region_agent.state.local` (no second schema to drift: a field added to
``RegionView`` travels as soon as its type validates), rejects NaN/inf, unknown message
types and versions, and copies filed under a key that is not their slug. Unknown extra
keys are ignored, so a newer agent can add fields without breaking an older sidecar.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from region_agent.state.local import CopyStatus, RegionView

__all__ = [
    "VERSION",
    "Delta",
    "FeedProtocolError",
    "Heartbeat",
    "Message",
    "Snapshot",
    "apply_delta",
    "decode",
    "encode_delta",
    "encode_heartbeat",
    "encode_snapshot",
]

VERSION = 1
_FIELDS = tuple(f.name for f in dataclasses.fields(RegionView))


class FeedProtocolError(ValueError):
    """A feed line that is not a valid message (the text says which part)."""


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)

    v: Literal[1]
    seq: int = Field(ge=0)


class Snapshot(_Message):
    type: Literal["snapshot"]
    view: RegionView


class Delta(_Message):
    type: Literal["delta"]
    view: RegionView  # every field but ``copies`` (empty) and, unless changed, ``bindings``
    bindings_changed: bool
    upsert: dict[str, CopyStatus]
    remove: list[str]


class Heartbeat(_Message):
    type: Literal["heartbeat"]


Message = Snapshot | Delta | Heartbeat
_ADAPTER: TypeAdapter[Message] = TypeAdapter(Annotated[Message, Field(discriminator="type")])


# --- encoding (agent side) ----------------------------------------------------------------


def _line(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _header(view: RegionView, *, with_bindings: bool) -> dict[str, Any]:
    out = {name: getattr(view, name) for name in _FIELDS}
    out["copies"] = {}
    out["bindings"] = [b.to_dict() for b in view.bindings] if with_bindings else []
    return out


def encode_snapshot(view: RegionView, seq: int) -> bytes:
    data = _header(view, with_bindings=True)
    data["copies"] = {slug: copy.to_dict() for slug, copy in view.copies.items()}
    return _line({"v": VERSION, "type": "snapshot", "seq": seq, "view": data})


def encode_delta(old: RegionView, new: RegionView, seq: int) -> bytes:
    """The changes from ``old`` (what the subscribers hold) to ``new``.

    Unchanged copies are usually the very same objects (the producer rebuilds only what
    changed), so the identity test skips most equality comparisons.
    """
    upsert: dict[str, Any] = {}
    remove: list[str] = []
    if new.copies is not old.copies:
        before = old.copies
        for slug, copy in new.copies.items():
            previous = before.get(slug)
            if previous is not copy and previous != copy:
                upsert[slug] = copy.to_dict()
        after = new.copies
        remove = [slug for slug in before if slug not in after]
    bindings_changed = new.bindings != old.bindings
    return _line({
        "v": VERSION, "type": "delta", "seq": seq, "view": _header(new, with_bindings=bindings_changed),
        "bindings_changed": bindings_changed, "upsert": upsert, "remove": remove,
    })


def encode_heartbeat(seq: int) -> bytes:
    return _line({"v": VERSION, "type": "heartbeat", "seq": seq})


# --- decoding (sidecar side) --------------------------------------------------------------


def decode(line: bytes) -> Message:
    """One line (with or without its newline) → a validated message, or FeedProtocolError."""
    try:
        message = _ADAPTER.validate_json(line)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[:3]
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in first)
        raise FeedProtocolError(f"invalid feed message ({exc.error_count()} errors): {where}") from None
    if isinstance(message, Snapshot):
        _check_keys(message.view.copies)
    elif isinstance(message, Delta):
        _check_keys(message.upsert)
    return message


def _check_keys(copies: Any) -> None:
    for slug, copy in copies.items():
        if slug != copy.slug:
            raise FeedProtocolError(f"invalid feed message: copy filed as {slug!r} has slug {copy.slug!r}")


def apply_delta(base: RegionView, delta: Delta) -> RegionView:
    copies = dict(base.copies)
    for slug in delta.remove:
        copies.pop(slug, None)
    copies.update(delta.upsert)
    bindings = delta.view.bindings if delta.bindings_changed else base.bindings
    return dataclasses.replace(delta.view, copies=copies, bindings=bindings)
