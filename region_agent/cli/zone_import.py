"""``region-agent zone import FILE``: write a zone file's regions and projects through the control API.

The file is validated by the same parser the agent uses (:func:`region_agent.zonefile.watcher.read_zone_file`),
then compared with what the agent reports (``GET /v1/regions``, ``GET /v1/projects``). Only the
differences are written: regions first (a project may only name known regions), projects second,
and with ``--prune`` the projects the file no longer lists are deleted last. Regions the file no
longer lists are left alone (a region still named by a project can not be deleted; remove them with
``DELETE /v1/regions/{name}`` once nothing uses them).

Every write carries a deterministic ``Idempotency-Key``: a hash of the method, the path, the body and
the agent's store digest read before planning (``GET /v1/digests``). A retry within a run (a 503, a
lost connection) sends the same key, so the agent replays its first answer instead of writing twice;
an import run again re-reads the agent and sends only what is still different. The digest (which
changes with every write, versions included) is part of the key so that a later import which must
restore a value somebody changed meanwhile, even back and forth, is not answered with the replay of
an earlier identical write (the agent keeps keys for a day).

Like the zone file watcher, ``--prune`` refuses to remove more than half of the projects at once
unless ``--force`` (an accidentally truncated file looks like that).

Retries: a 503 (the agent does not see a majority of regions) is retried after its ``Retry-After``
(capped by ``--max-wait``), and a request whose connection failed is retried with a short backoff,
``--retries`` times in all per request. Any other 4xx or 5xx stops the import at once with the
API's error and the field it names; what was written before stays written (every write is a full
replacement, so running the import again finishes the job).

Exit codes: 0 done (or nothing to do), 1 transport or API failure, 2 bad file or arguments
(a refused prune included: nothing was written).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from region_agent.cli.operator_client import add_operator_arguments, operator_target
from region_agent.state.model import Project, Region
from region_agent.zonefile.watcher import DEFAULT_MAX_BYTES, ZoneData, ZoneFileError, read_zone_file

__all__ = ["Change", "ZoneImportError", "add_zone_import_parser", "idempotency_key", "plan_changes", "run_import"]

DEFAULT_RETRIES = 5
DEFAULT_MAX_WAIT = 30.0
DEFAULT_TIMEOUT = 10.0
_TRANSPORT_BACKOFF = (0.2, 0.5, 1.0, 2.0, 5.0)


class ZoneImportError(Exception):
    """The import stops; ``code`` is the exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Change:
    method: str  # PUT or DELETE
    kind: str  # region or project
    name: str
    body: dict[str, Any] | None  # None for DELETE
    before: dict[str, Any] | None  # what the agent reported (None: it had none)

    @property
    def path(self) -> str:
        return f"/v1/{self.kind}s/{self.name}"

    @property
    def verb(self) -> str:
        if self.method == "DELETE":
            return "delete"
        return "create" if self.before is None else "change"

    def fields(self) -> list[str]:
        """The fields a change alters (empty for a create or a delete)."""
        if self.before is None or self.body is None:
            return []
        return sorted(k for k in set(self.body) | set(self.before) if self.body.get(k) != self.before.get(k))

    def encoded(self) -> bytes:
        return b"" if self.body is None else _canonical(self.body)


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def idempotency_key(method: str, path: str, body: bytes, state: str = "") -> str:
    """``zone-import-<sha256>`` of the method, the path, the body and the store digest read before planning."""
    h = hashlib.sha256()
    for part in (method.encode(), path.encode(), body, state.encode()):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return "zone-import-" + h.hexdigest()


def _same(kind: str, current: Mapping[str, Any], wanted: Region | Project) -> bool:
    """Whether the agent's record equals the file's (compared as model records, so defaults agree)."""
    try:
        parsed: Region | Project = (Region.from_dict(dict(current)) if kind == "region"
                                    else Project.from_dict(dict(current)))
    except (KeyError, TypeError, ValueError):
        return False
    return parsed == wanted


def plan_changes(data: ZoneData, regions: Mapping[str, dict[str, Any]], projects: Mapping[str, dict[str, Any]], *,
                 prune: bool) -> tuple[list[Change], dict[str, int]]:
    """The writes that make the agent's regions and projects equal the file's, in order (pure).

    Returns the changes and the number of unchanged regions and projects.
    """
    changes: list[Change] = []
    unchanged = {"region": 0, "project": 0}
    for kind, wanted, current in (("region", data.regions, regions), ("project", data.projects, projects)):
        for name in sorted(wanted):
            record = wanted[name]
            before = current.get(name)
            if before is not None and _same(kind, before, record):
                unchanged[kind] += 1
                continue
            changes.append(Change("PUT", kind, name, record.to_dict(), before))
    if prune:
        changes.extend(Change("DELETE", "project", slug, None, projects[slug])
                       for slug in sorted(projects.keys() - data.projects.keys()))
    return changes, unchanged


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None

    def error(self) -> str:
        """``<status> <field>: <error>`` from the API's JSON error body (or the raw body)."""
        data = self.json()
        if isinstance(data, dict) and "error" in data:
            where = f" {data['field']}" if data.get("field") else ""
            return f"{self.status}{where}: {data['error']}"
        text = self.body[:300].decode(errors="replace").strip()
        return f"{self.status}: {text or 'no body'}"


@dataclass
class Client:
    """One keep-alive HTTP connection to the agent's operator listener, reopened when it breaks."""

    url: str
    token: str
    timeout: float = DEFAULT_TIMEOUT
    retries: int = DEFAULT_RETRIES
    max_wait: float = DEFAULT_MAX_WAIT
    sleep: Callable[[float], None] = time.sleep
    waits: list[float] = field(default_factory=list)  # every pause taken before a retry (seconds)
    _conn: http.client.HTTPConnection | None = None

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ZoneImportError(f"--url {self.url!r} is not an http:// or https:// URL", 2)
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._base = parts.path.rstrip("/")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            kind = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            self._conn = kind(self._host, self._port, timeout=self.timeout)
        return self._conn

    def _once(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        conn = self._connection()
        try:
            conn.request(method, self._base + path, body=body or None, headers=dict(headers))
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if response.will_close:
            self.close()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, data)

    def request(self, method: str, path: str, body: bytes = b"", key: str | None = None) -> Answer:
        """The answer, after retrying 503s (``Retry-After``) and broken connections; raises ZoneImportError (1)."""
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if body:
            headers["Content-Type"] = "application/json"
        if key is not None:
            headers["Idempotency-Key"] = key
        attempt = 0
        while True:
            attempt += 1
            try:
                answer = self._once(method, path, body, headers)
            except (OSError, http.client.HTTPException) as exc:
                if attempt > self.retries:
                    raise ZoneImportError(f"{method} {path}: {str(exc) or type(exc).__name__} "
                                       f"(gave up after {attempt} attempts)", 1) from None
                self._pause(_TRANSPORT_BACKOFF[min(attempt - 1, len(_TRANSPORT_BACKOFF) - 1)])
                continue
            if answer.status != 503:
                return answer
            if attempt > self.retries:
                raise ZoneImportError(f"{method} {path}: {answer.error()} (still 503 after {attempt} attempts)", 1)
            self._pause(_retry_after(answer.headers.get("retry-after"), self.max_wait))

    def _pause(self, seconds: float) -> None:
        seconds = min(max(0.0, seconds), self.max_wait)
        self.waits.append(seconds)
        self.sleep(seconds)


def _retry_after(value: str | None, cap: float) -> float:
    """Seconds from a ``Retry-After`` header (delta-seconds; an HTTP date or nonsense: 1 s), at most ``cap``."""
    if value is None:
        return min(1.0, cap)
    try:
        seconds = float(value.strip())
    except ValueError:
        return min(1.0, cap)
    return min(max(0.0, seconds), cap)


def _listing(client: Client, kind: str) -> dict[str, dict[str, Any]]:
    path = f"/v1/{kind}s"
    answer = client.request("GET", path)
    if answer.status != 200:
        raise ZoneImportError(f"GET {path}: {answer.error()}", 1)
    data = answer.json()
    items = data.get(f"{kind}s") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ZoneImportError(f"GET {path}: not a {kind} list (is {client.url} a region-agent operator listener?)", 1)
    key = "name" if kind == "region" else "slug"
    return {str(item[key]): item for item in items if isinstance(item, dict) and key in item}


def _digest(client: Client) -> str:
    """The agent's store digest (versions included): part of every idempotency key of this run."""
    answer = client.request("GET", "/v1/digests")
    if answer.status != 200:
        raise ZoneImportError(f"GET /v1/digests: {answer.error()}", 1)
    data = answer.json()
    digest = data.get("digest") if isinstance(data, dict) else None
    if not isinstance(digest, str):
        raise ZoneImportError(f"GET /v1/digests: no digest (is {client.url} a region-agent operator listener?)", 1)
    return digest


def _describe(change: Change, *, dry_run: bool, replayed: bool = False) -> str:
    sign = {"create": "+", "change": "~", "delete": "-"}[change.verb]
    fields = change.fields()
    detail = f" ({', '.join(fields)})" if fields else ""
    verb = f"would {change.verb}" if dry_run else {"create": "created", "change": "changed",
                                                     "delete": "deleted"}[change.verb]
    note = " (replayed)" if replayed else ""
    return f"{sign} {change.kind} {change.name}: {verb}{detail}{note}"


def run_import(path: Path, url: str, token_file: Path, *, dry_run: bool = False, prune: bool = False,
               force: bool = False, retries: int = DEFAULT_RETRIES, max_wait: float = DEFAULT_MAX_WAIT,
               timeout: float = DEFAULT_TIMEOUT, max_bytes: int = DEFAULT_MAX_BYTES,
               out: TextIO | None = None, err: TextIO | None = None,
               sleep: Callable[[float], None] = time.sleep) -> int:
    """Import ``path`` into the agent at ``url``; prints one line per change and a summary; the exit code."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        try:
            data = read_zone_file(path, max_bytes)
        except ZoneFileError as exc:
            raise ZoneImportError(str(exc), 2) from None
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ZoneImportError(f"--token-file {token_file}: {exc.strerror or exc}", 2) from None
        if not token:
            raise ZoneImportError(f"--token-file {token_file}: empty", 2)
        client = Client(url, token, timeout=timeout, retries=retries, max_wait=max_wait, sleep=sleep)
        try:
            return _import(client, data, path, dry_run=dry_run, prune=prune, force=force, out=out)
        finally:
            client.close()
    except ZoneImportError as exc:
        print(f"region-agent zone import: {exc}", file=err)
        return exc.code


def _import(client: Client, data: ZoneData, path: Path, *, dry_run: bool, prune: bool, force: bool,
            out: TextIO) -> int:
    state = _digest(client)
    regions = _listing(client, "region")
    projects = _listing(client, "project")
    changes, unchanged = plan_changes(data, regions, projects, prune=prune)
    deletes = sum(1 for c in changes if c.method == "DELETE")
    if deletes * 2 > len(projects) and not force:
        raise ZoneImportError(f"{path}: would delete {deletes} of the agent's {len(projects)} projects (more than "
                           "half at once); refused, nothing written. If that is meant, add --force", 2)
    done = {"region": {"create": 0, "change": 0}, "project": {"create": 0, "change": 0, "delete": 0}}
    replays = 0
    for change in changes:
        if dry_run:
            print(_describe(change, dry_run=True), file=out, flush=True)
            done[change.kind][change.verb] += 1
            continue
        body = change.encoded()
        key = idempotency_key(change.method, change.path, body, state)
        answer = client.request(change.method, change.path, body, key)
        if change.method == "DELETE" and answer.status == 404:
            print(f"- project {change.name}: already gone", file=out, flush=True)
            continue
        if not 200 <= answer.status < 300:
            raise ZoneImportError(f"{change.method} {change.path}: {answer.error()} (stopped; the changes above "
                               "were written)", 1)
        replayed = answer.headers.get("idempotent-replayed") == "true"
        replays += replayed
        print(_describe(change, dry_run=False, replayed=replayed), file=out, flush=True)
        done[change.kind][change.verb] += 1
    kept = sorted(regions.keys() - data.regions.keys())
    r, p = done["region"], done["project"]
    summary = (f"regions: {r['create']} created, {r['change']} changed, {unchanged['region']} unchanged; "
               f"projects: {p['create']} created, {p['change']} changed, {p['delete']} deleted, "
               f"{unchanged['project']} unchanged")
    extra = []
    if not prune and (stale := len(projects.keys() - data.projects.keys())):
        extra.append(f"{stale} project(s) not in the file kept (--prune deletes them)")
    if kept:
        extra.append(f"region(s) not in the file kept: {', '.join(kept)}")
    if replays:
        extra.append(f"{replays} answer(s) replayed by the agent")
    prefix = "dry run, nothing written: " if dry_run else ""
    print(f"{prefix}{summary}" + "".join(f"; {e}" for e in extra), file=out, flush=True)
    return 0


def cmd_zone_import(args: argparse.Namespace) -> int:
    url, token_file = operator_target(args)
    if not token_file:
        print("region-agent zone import: --token-file is required (the control API needs the bearer token; "
              "or --config with health.operator_token_file)", file=sys.stderr)
        return 2
    return run_import(Path(args.file), url, Path(token_file), dry_run=args.dry_run, prune=args.prune,
                      force=args.force, retries=args.retries, max_wait=args.max_wait, timeout=args.timeout,
                      max_bytes=args.max_bytes)


def add_zone_import_parser(zone: argparse.ArgumentParser) -> None:
    """``zone import`` as a subcommand of the ``zone`` parser (``zone`` alone still prints the zone)."""
    sub = zone.add_subparsers(dest="zone_command", metavar="{import}")
    imp = sub.add_parser("import", help="write a zone file's regions and projects through the control API",
                         description=(__doc__ or "").split("\n\n")[0])
    imp.add_argument("file", metavar="FILE", help="zone file (the standalone YAML format)")
    # SUPPRESS: ``zone --url X import FILE`` keeps the X given before the subcommand.
    add_operator_arguments(imp, default=argparse.SUPPRESS)
    imp.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    imp.add_argument("--prune", action="store_true", help="delete the projects the file does not list")
    imp.add_argument("--force", action="store_true", help="with --prune: allow deleting more than half the projects")
    imp.add_argument("--retries", type=_non_negative_int, default=DEFAULT_RETRIES,
                     help=f"retries per request after a 503 or a broken connection (default {DEFAULT_RETRIES})")
    imp.add_argument("--max-wait", type=float, default=DEFAULT_MAX_WAIT,
                     help=f"longest pause before a retry, whatever Retry-After says (default {DEFAULT_MAX_WAIT:g} s)")
    imp.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per request (default 10)")
    imp.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                     help="largest zone file accepted (the agent's zone_file_max_bytes; default 1 MiB)")
    imp.set_defaults(func=cmd_zone_import)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value

