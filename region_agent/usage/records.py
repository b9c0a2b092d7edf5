"""Usage records: one slice of one session, as the control plane receives it.

A record's JSON text is made once, when the slice is spooled, and stored verbatim; every
retry sends the same bytes. Its idempotency key is ``sha256(region, pod uid, slice start)``:
slices of a pod never overlap and are never empty (see :mod:`region_agent.usage.sessions`), so two
different records can not share a key, and a record retried after a lost answer always carries
the key the control plane has already seen. The wire format is documented in README.md; keep
the two in step (``SCHEMA_VERSION`` goes up on any incompatible change).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from region_agent.usage.sessions import Slice

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class Record:
    """A record ready for the spool: key, exact JSON text, and the seconds it bills."""

    key: str
    body: str
    seconds: int


def record_key(region: str, pod_uid: str, start: int) -> str:
    """The idempotency key: 64 hex characters, stable across processes, restarts and retries."""
    return hashlib.sha256(f"usage/v1\n{region}\n{pod_uid}\n{start}".encode()).hexdigest()


def make_record(piece: Slice, *, region: str, node: str) -> Record:
    ident = piece.identity
    key = record_key(region, ident.uid, piece.start)
    body = {
        "key": key,
        "region": region,
        "node": node,
        "slug": ident.slug,
        "namespace": ident.namespace,
        "service": ident.service,
        "revision": ident.revision,
        "pod": ident.name,
        "pod_uid": ident.uid,
        "session_start": piece.session_start,
        "start": piece.start,
        "end": piece.end,
        "seconds": piece.seconds,
        "final": piece.final,
        "end_reason": None if piece.end_reason is None else piece.end_reason.value,
        "size": piece.size.to_wire(),
        "always_on": ident.always_on,
        "min_scale": ident.min_scale,
    }
    return Record(key, json.dumps(body, sort_keys=True, separators=(",", ":")), piece.seconds)


def batch_body(records_json: list[str], *, region: str, node: str, sent_at: float) -> bytes:
    """The POST body: the stored record texts spliced in as they are (no re-encoding)."""
    head = json.dumps({"schema": SCHEMA_VERSION, "region": region, "node": node,
                       "sent_at": round(sent_at, 3)}, separators=(",", ":"))
    return (head[:-1] + ',"records":[' + ",".join(records_json) + "]}").encode()
