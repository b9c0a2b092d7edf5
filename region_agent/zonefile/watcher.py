"""Standalone mode's source of truth: a YAML file of regions and projects.

```yaml
regions:
  sfo1: {ipv4: [203.0.113.10], ns_ipv4: [203.0.113.53], latitude: 37.62, longitude: -122.38}
  ams1: {ipv4: [198.51.100.10], ns_ipv4: [198.51.100.53], latitude: 52.31, longitude: 4.76}
projects:
  shop: {regions: [sfo1, ams1], primary: sfo1, mode: ha, all_down: all}
```

The file is validated whole before anything changes: a bad file raises
:class:`ZoneFileError` naming the problem (its ``reason`` is the metric label), and the
store keeps the zone it had. Refused: a file that is not UTF-8, larger than the size limit,
empty or only comments, without regions, not valid YAML, with a key given twice in one
mapping, with a field the model refuses; and, unless the operator allows it, a change that
removes more than half of the projects at once (an accidental truncation looks like that).
A good file replaces the store's regions and projects (what it no longer lists is deleted)
in one batch write, so listeners hear about a reload once.

:class:`ZoneFileWatcher` re-reads the file on SIGHUP and when its (inode, size, mtime)
changes. Reading and parsing run in a daemon thread, so a big file does not stall DNS and
a stop never waits for a parse. A change is applied only once the file has been stable for
a settle interval (the same stat and hash on two reads), so a truncate-then-write is never
served half-written; and only when its content differs from what is applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from region_agent.base.files import FileWatcher
from region_agent.base.gc_pause import freeze_survivors, gc_paused
from region_agent.state.model import (
    AllDownPolicy,
    Key,
    Mode,
    ModelError,
    PartitionPolicy,
    Project,
    Region,
    Value,
    copy_key,
    project_key,
    region_key,
)
from region_agent.state.store import Store, put_many_off_loop

try:  # libyaml: about ten times faster than the pure-Python parser
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]

logger = logging.getLogger("region_agent.zonefile")

DEFAULT_MAX_BYTES = 1 << 20  # a Kubernetes ConfigMap holds at most 1 MiB
REASONS = ("io", "too-large", "not-utf8", "empty", "yaml", "duplicate-key", "invalid", "no-regions",
           "mass-removal", "unstable", "internal")
# Refusals not caused by the content: retried on every poll, not only when the file changes.
_RETRIED = frozenset({"io", "unstable", "internal"})
_T = TypeVar("_T")


class ZoneFileError(ValueError):
    """A zone file that can not be used; the message names the file and the problem."""

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(_SafeLoader):
    """The safe loader, refusing a key given twice in one mapping (YAML says keys are unique).

    PyYAML keeps the last value silently: a second ``projects:`` block would replace the
    first. Merge keys (``<<``) may still be overridden, as YAML intends.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)  # cached: not built twice
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base constructor names it
            if first is not None:
                raise _DuplicateKey(f"duplicate key {key!r} at line {line} (first at line {first})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _RegionEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ipv4: list[str] = Field(default_factory=list)
    ipv6: list[str] = Field(default_factory=list)
    ns_ipv4: list[str] = Field(default_factory=list)
    ns_ipv6: list[str] = Field(default_factory=list)
    latitude: float | None = None
    longitude: float | None = None
    witness: bool = False   # a region that votes and holds no copies (its agents run cluster.role: witness)


class _ProjectEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    regions: list[str]
    primary: str | None = None
    mode: Mode = Mode.HA
    all_down: AllDownPolicy = AllDownPolicy.ALL
    partition: PartitionPolicy | None = None


class _ZoneFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    regions: dict[str, _RegionEntry] = Field(default_factory=dict)
    projects: dict[str, _ProjectEntry] = Field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ZoneData:
    regions: dict[str, Region]
    projects: dict[str, Project]

    def copies(self) -> set[tuple[str, str]]:
        return {(slug, r) for slug, p in self.projects.items() for r in p.regions}


def _validate(raw: dict[Any, Any], source: str) -> _ZoneFile:
    """The document as models, one entry at a time.

    One ``model_validate`` of the whole document would hold the GIL for its whole run (about
    0.1 s for 10,000 projects; the validator is native code), stalling the event loop while
    this runs in the read thread. Per entry, the loop gets its turns in between.
    """
    problems: list[str] = []
    unknown = [str(k) for k in raw if k not in _ZoneFile.model_fields]
    problems.extend(f"{k}: Extra inputs are not permitted" for k in unknown)
    sections: dict[str, dict[str, Any]] = {}
    for field, model in (("regions", _RegionEntry), ("projects", _ProjectEntry)):
        entries = raw.get(field, {})
        if not isinstance(entries, dict):
            problems.append(f"{field}: Input should be a valid dictionary")
            continue
        parsed: dict[str, Any] = {}
        for name, value in entries.items():
            if not isinstance(name, str):
                problems.append(f"{field}.{name}: a name must be a string")
                continue
            try:
                parsed[name] = model.model_validate(value)
            except ValidationError as exc:
                problems.extend(f"{'.'.join(str(p) for p in (field, name, *e['loc']))}: {e['msg']}"
                                for e in exc.errors())
        sections[field] = parsed
    if problems:
        raise ZoneFileError(f"{source}: {'; '.join(problems)}")
    return _ZoneFile.model_construct(regions=sections["regions"], projects=sections["projects"])


def parse_zone_data(raw: Any, source: str = "zone file") -> ZoneData:
    """Validate a parsed document; refuses one without regions (an empty file parses to None)."""
    if raw is None:
        raise ZoneFileError(f"{source}: no regions and no projects (empty, or only comments)", "empty")
    if not isinstance(raw, dict):
        raise ZoneFileError(f"{source}: must be a mapping with 'regions' and 'projects'")
    parsed = _validate(raw, source)
    if not parsed.regions:
        raise ZoneFileError(f"{source}: no regions (a zone needs at least one)", "no-regions")
    regions: dict[str, Region] = {}
    projects: dict[str, Project] = {}
    try:
        for name, r in parsed.regions.items():
            regions[name] = Region(name, tuple(r.ipv4), tuple(r.ipv6), tuple(r.ns_ipv4), tuple(r.ns_ipv6),
                                   r.latitude, r.longitude, r.witness)
        for slug, p in parsed.projects.items():
            projects[slug] = Project(slug, tuple(p.regions), p.primary, p.mode, p.all_down, p.partition)
    except (ModelError, ValueError) as exc:
        raise ZoneFileError(f"{source}: {exc}") from None
    for slug, project in projects.items():
        unknown = [r for r in project.regions if r not in regions]
        if unknown:
            raise ZoneFileError(f"{source}: projects.{slug}.regions: unknown region(s) {', '.join(unknown)}")
    return ZoneData(regions, projects)


def parse_zone_bytes(data: bytes, source: str = "zone file") -> ZoneData:
    """Decode, parse (libyaml, duplicate keys refused) and validate the file's bytes."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ZoneFileError(f"{source}: not UTF-8: byte 0x{data[exc.start]:02x} at line {line} "
                            f"(offset {exc.start})", "not-utf8") from None
    if not text.strip():
        raise ZoneFileError(f"{source}: the file is empty", "empty")
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except _DuplicateKey as exc:
        raise ZoneFileError(f"{source}: {exc}", "duplicate-key") from None
    except yaml.YAMLError as exc:
        raise ZoneFileError(f"{source}: not valid YAML: {exc}", "yaml") from None
    return parse_zone_data(raw, source)


@dataclass(frozen=True, slots=True)
class FileContent:
    stamp: tuple[int, int, int]  # (mtime ns, size, inode), as file_signature
    digest: str
    data: bytes


def read_content(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> FileContent:
    """The file's bytes, refused above ``max_bytes``; blocking (run it off the loop)."""
    try:
        # O_NONBLOCK: a FIFO put where the file should be must not hang the reader.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as handle:
            st = os.fstat(handle.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ZoneFileError(f"{path}: not a regular file", "io")
            if st.st_size > max_bytes:
                raise ZoneFileError(f"{path}: {st.st_size} bytes, more than the limit of {max_bytes} "
                                    "(zone_file_max_bytes)", "too-large")
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise ZoneFileError(f"{path}: {exc.strerror or exc}", "io") from None
    if len(data) > max_bytes:
        raise ZoneFileError(f"{path}: more than the limit of {max_bytes} bytes (zone_file_max_bytes)", "too-large")
    return FileContent((st.st_mtime_ns, st.st_size, st.st_ino), hashlib.sha256(data).hexdigest(), data)


def read_zone_file(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> ZoneData:
    """Read and validate the file; any problem is a :class:`ZoneFileError` (blocking)."""
    return parse_zone_bytes(read_content(path, max_bytes).data, str(path))


def check_removals(current: set[str], data: ZoneData, *, allowed: bool, source: str) -> int:
    """Refuse removing more than half of ``current`` projects unless ``allowed``; returns the count."""
    removed = len(current - data.projects.keys())
    if removed * 2 > len(current) and not allowed:
        raise ZoneFileError(
            f"{source}: would remove {removed} of {len(current)} projects (more than half at once); "
            "refused. If that is meant, set zone_file_allow_mass_removal: true and send SIGHUP",
            "mass-removal")
    return removed


def zone_changes(store: Store, data: ZoneData) -> list[tuple[Key, Value | None]]:
    """The writes that make the store's regions and projects equal ``data``'s.

    Copy health of a project or region the file no longer pairs is deleted with them.
    """
    items: list[tuple[Key, Value | None]] = []
    for name, region in data.regions.items():
        if store.regions.get(name) != region:
            items.append((region_key(name), region))
    for slug, project in data.projects.items():
        if store.projects.get(slug) != project:
            items.append((project_key(slug), project))
    items.extend((project_key(slug), None) for slug in store.projects.keys() - data.projects.keys())
    items.extend((region_key(name), None) for name in store.regions.keys() - data.regions.keys())
    items.extend((copy_key(*pair), None) for pair in store.copies.keys() - data.copies())
    return items


def diff_zone_data(old: ZoneData, new: ZoneData) -> list[tuple[Key, Value | None]]:
    """The writes that turn ``old`` into ``new`` (:func:`zone_changes` without reading a store).

    Pure, so the zone file watcher computes it off the loop; copy health is deleted for
    the (project, region) pairs ``new`` no longer has.
    """
    items: list[tuple[Key, Value | None]] = []
    items.extend((region_key(n), r) for n, r in new.regions.items() if old.regions.get(n) != r)
    items.extend((project_key(s), p) for s, p in new.projects.items() if old.projects.get(s) != p)
    items.extend((project_key(s), None) for s in old.projects.keys() - new.projects.keys())
    items.extend((region_key(n), None) for n in old.regions.keys() - new.regions.keys())
    for slug, project in old.projects.items():
        now = new.projects.get(slug)
        if now is None or now.regions != project.regions:
            kept = () if now is None else now.regions
            items.extend((copy_key(slug, r), None) for r in project.regions if r not in kept)
    return items


def apply_zone_data(store: Store, data: ZoneData) -> int:
    """Make the store's regions and projects equal the file's in one batch; returns keys changed."""
    return len(store.put_many(zone_changes(store, data)))


async def off_loop(function: Callable[..., _T], *args: Any) -> _T:
    """Run ``function(*args)`` in a daemon thread and await its result.

    Not the default executor: ``asyncio.run`` joins its threads at exit, so a stop would
    wait for a parse that nobody awaits any more. A cancelled caller leaves the thread to
    finish alone; its result is dropped.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result = function(*args)
        except BaseException as exc:  # handed to the awaiting task
            outcome: tuple[_T | None, BaseException | None] = (None, exc)
        else:
            outcome = (result, None)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, name="zone-file-read", daemon=True).start()
    return await future


class ZoneFileWatcher:
    """Re-reads the zone file on SIGHUP or when it changes; a bad file never ends the watch."""

    def __init__(self, path: Path, store: Store, registry: CollectorRegistry, *, poll_interval: float,
                 settle: float = 0.5, max_bytes: int = DEFAULT_MAX_BYTES,
                 allow_mass_removal: Callable[[], bool] = lambda: False, settle_rounds: int = 20,
                 writer: str | None = None) -> None:
        self.path = path
        self.store = store
        # In cluster mode the file is an import by the control role (``control/<node>``): it writes
        # regions and projects, never copy health, which only each copy's region writes.
        self.writer = writer
        self.poll_interval = poll_interval
        self.settle = settle
        self.settle_rounds = settle_rounds
        self.max_bytes = max_bytes
        # Called in the read thread on every read, so it may re-read a settings file: setting
        # the override and sending SIGHUP confirms a refused mass removal without a restart.
        self.allow_mass_removal = allow_mass_removal
        # Why the file on disk is not the zone served; when to read it again (refused content is not
        # read again until it changes, or on SIGHUP).
        self.watch = FileWatcher(path, what="zone file", keeping="serving the previous zone", logger=logger,
                                 level=logging.ERROR)
        self._applied: str | None = None  # hash of the content the store holds
        self._refused: str | None = None  # hash of the last refused content: polls do not retry it
        self._data: ZoneData | None = None  # what the store holds from the file (the watcher is its writer)
        self.reloads = Counter("region_agent_zone_file_reloads", "Zone file reads applied", registry=registry)
        self.errors = Counter("region_agent_zone_file_errors", "Zone file reads refused (the old zone stays)",
                              ["reason"], registry=registry)
        for reason in REASONS:
            self.errors.labels(reason)
        self.last_success = Gauge("region_agent_zone_file_last_success_timestamp_seconds",
                                  "Wall time of the last good zone file read", registry=registry)

    @property
    def problem(self) -> str | None:
        """Why the file on disk is not the zone served, or None."""
        return self.watch.problem

    @problem.setter
    def problem(self, message: str | None) -> None:
        # The supervisor records a refused first import (cluster mode) this way.
        if message is None:
            self.watch.accept()
        else:
            self.watch.refuse(message, retry=False)

    def problems(self) -> tuple[str, ...]:
        return self.watch.problems()

    def _read(self) -> tuple[FileContent, bool]:
        return read_content(self.path, self.max_bytes), self.allow_mass_removal()

    async def load(self) -> None:
        """Read and apply the file now (at start); raises :class:`ZoneFileError` on a bad file."""
        content, allowed = await off_loop(self._read)
        await self._apply(content, allowed)

    def request_reload(self) -> None:
        """Ask for a re-read (the SIGHUP handler); safe to call from a signal handler."""
        self.watch.request_reload()

    async def run(self) -> None:
        await self.watch.run(self._poll, self.poll_interval)

    async def _poll(self, forced: bool) -> None:
        try:
            await self.check(forced=forced)
        except ZoneFileError as exc:
            self._refuse(exc.reason, str(exc), forced)
        except Exception as exc:  # a bad file must never end the watch
            logger.exception("zone file %s: unexpected error", self.path)
            self._refuse("internal", f"{self.path}: {type(exc).__name__}: {exc}", forced)

    def _refuse(self, reason: str, message: str, forced: bool) -> None:
        self.errors.labels(reason).inc()
        # Not about the content (_RETRIED): try again on the next poll. A problem that persists
        # across polls is logged once, and again on every SIGHUP.
        self.watch.refuse(message, retry=reason in _RETRIED, again=forced, reason=reason)

    async def check(self, *, forced: bool) -> bool:
        """Apply the file if it changed (or on SIGHUP) and is stable; returns whether it applied."""
        if not forced and not self.watch.due():
            return False
        self.watch.mark()  # a bad file is refused once, not on every poll
        content, allowed = await self._settled_read()
        self.watch.mark((content.stamp,))
        if content.digest == self._applied:
            self.watch.accept()
            return False  # touched, rewritten the same, or SIGHUP without a change: nothing to do
        if content.digest == self._refused and not forced:
            return False
        await self._apply(content, allowed)
        return True

    async def _settled_read(self) -> tuple[FileContent, bool]:
        """Read until two reads a settle interval apart agree on stat and hash."""
        first, _ = await off_loop(self._read)
        for _round in range(self.settle_rounds):
            await asyncio.sleep(self.settle)
            second, allowed = await off_loop(self._read)
            if second.stamp == first.stamp and second.digest == first.digest:
                return second, allowed
            first = second
        raise ZoneFileError(f"{self.path}: still changing after {self.settle_rounds} reads "
                            f"{self.settle} s apart", "unstable")

    async def _apply(self, content: FileContent, allowed: bool) -> None:
        previous = self._data
        if previous is not None and (self.store.projects.keys() != previous.projects.keys()
                                     or self.store.regions.keys() != previous.regions.keys()):
            previous = None  # someone else wrote regions or projects: compare with the store
        try:
            data, removed, writes = await off_loop(self._prepare, content.data, previous, allowed)
            if previous is None:
                removed = check_removals(set(self.store.projects), data, allowed=allowed, source=str(self.path))
                writes = zone_changes(self.store, data)
        except ZoneFileError:
            self._refused = content.digest
            raise
        copies = self.store.copies
        if self.writer is not None:
            writes = [(key, value) for key, value in writes if key[0] != "copy"]
        changed = len(await put_many_off_loop(
            self.store, [(key, value) for key, value in writes
                         if value is not None or key[0] != "copy" or (key[1], key[2]) in copies],
            writer=self.writer))
        self._data = data
        self._applied, self._refused = content.digest, None
        self.watch.accept()
        self.reloads.inc()
        self.last_success.set(time.time())
        logger.info("zone file %s: %d regions, %d projects (%d removed), %d keys changed", self.path,
                    len(data.regions), len(data.projects), removed, changed)

    def _prepare(self, raw: bytes, previous: ZoneData | None,
                 allowed: bool) -> tuple[ZoneData, int, list[tuple[Key, Value | None]]]:
        """In the read thread: parse, and against the last applied data the removal check and the writes."""
        with gc_paused():
            data = parse_zone_bytes(raw, str(self.path))
            # What the parse left alive is the new data: out of the collector's reach before
            # collections resume, or the first one would scan all of it (see region_agent.base.gc_pause).
            freeze_survivors()
            if previous is None:
                return data, 0, []
            removed = check_removals(set(previous.projects), data, allowed=allowed, source=str(self.path))
            return data, removed, diff_zone_data(previous, data)
