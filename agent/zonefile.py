"""Standalone mode's source of truth: a YAML file of regions and projects.

```yaml
regions:
  sfo1: {ipv4: [203.0.113.10], ns_ipv4: [203.0.113.53], latitude: 37.62, longitude: -122.38}
  ams1: {ipv4: [198.51.100.10], ns_ipv4: [198.51.100.53], latitude: 52.31, longitude: 4.76}
projects:
  shop: {regions: [sfo1, ams1], primary: sfo1, mode: ha, all_down: all}
```

The file is validated whole before anything changes: a bad file raises
:class:`ZoneFileError` naming the field, and the store keeps the zone it had. A good file
replaces the store's regions and projects (what the file no longer lists is deleted).
:class:`ZoneFileWatcher` re-reads it on SIGHUP and when it changes on disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.state.model import (
    AllDownPolicy,
    CopyHealth,
    Kind,
    Mode,
    ModelError,
    Project,
    Region,
    copy_key,
    project_key,
    region_key,
)
from agent.state.store import Store

logger = logging.getLogger("region_agent.zonefile")


class ZoneFileError(ValueError):
    """A zone file that can not be used; the message names the file and the field."""


class _RegionEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ipv4: list[str] = Field(default_factory=list)
    ipv6: list[str] = Field(default_factory=list)
    ns_ipv4: list[str] = Field(default_factory=list)
    ns_ipv6: list[str] = Field(default_factory=list)
    latitude: float | None = None
    longitude: float | None = None


class _ProjectEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    regions: list[str]
    primary: str | None = None
    mode: Mode = Mode.HA
    all_down: AllDownPolicy = AllDownPolicy.ALL


class _ZoneFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    regions: dict[str, _RegionEntry] = Field(default_factory=dict)
    projects: dict[str, _ProjectEntry] = Field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ZoneData:
    regions: dict[str, Region]
    projects: dict[str, Project]


def parse_zone_data(raw: Any, source: str = "zone file") -> ZoneData:
    if raw is None:
        raw = {}
    try:
        parsed = _ZoneFile.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ZoneFileError(f"{source}: {problems}") from None
    regions: dict[str, Region] = {}
    projects: dict[str, Project] = {}
    try:
        for name, r in parsed.regions.items():
            regions[name] = Region(name, tuple(r.ipv4), tuple(r.ipv6), tuple(r.ns_ipv4), tuple(r.ns_ipv6),
                                   r.latitude, r.longitude)
        for slug, p in parsed.projects.items():
            projects[slug] = Project(slug, tuple(p.regions), p.primary, p.mode, p.all_down)
    except (ModelError, ValueError) as exc:
        raise ZoneFileError(f"{source}: {exc}") from None
    for slug, project in projects.items():
        unknown = [r for r in project.regions if r not in regions]
        if unknown:
            raise ZoneFileError(f"{source}: projects.{slug}.regions: unknown region(s) {', '.join(unknown)}")
    return ZoneData(regions, projects)


def read_zone_file(path: Path) -> ZoneData:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ZoneFileError(f"{path}: {exc.strerror or exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ZoneFileError(f"{path}: not valid YAML: {exc}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ZoneFileError(f"{path}: must be a mapping with 'regions' and 'projects'")
    return parse_zone_data(raw, str(path))


def apply_zone_data(store: Store, data: ZoneData) -> int:
    """Make the store's regions and projects equal the file's; returns how many keys changed."""
    changed = 0
    for name, region in data.regions.items():
        changed += store.put(region_key(name), region) is not None
    for slug, project in data.projects.items():
        changed += store.put(project_key(slug), project) is not None
    copies_in_use = {(slug, r) for slug, p in data.projects.items() for r in p.regions}
    for key in store.keys_of(Kind.PROJECT):
        if key[1] not in data.projects:
            changed += store.delete(key) is not None
    for key in store.keys_of(Kind.REGION):
        if key[1] not in data.regions:
            changed += store.delete(key) is not None
    for key in store.keys_of(Kind.COPY):
        if (key[1], key[2]) not in copies_in_use and isinstance(store.get(key), CopyHealth):
            changed += store.delete(copy_key(key[1], key[2])) is not None
    return changed


class ZoneFileWatcher:
    """Re-reads the zone file on SIGHUP or when its (inode, size, mtime) changes."""

    def __init__(self, path: Path, store: Store, registry: CollectorRegistry, *, poll_interval: float) -> None:
        self.path = path
        self.store = store
        self.poll_interval = poll_interval
        self._stamp: tuple[int, int, int] | None = None
        self._wake = asyncio.Event()
        self.reloads = Counter("region_agent_zone_file_reloads", "Zone file reads applied", registry=registry)
        self.errors = Counter("region_agent_zone_file_errors", "Zone file reads refused (the old zone stays)",
                              registry=registry)
        self.last_success = Gauge("region_agent_zone_file_last_success_timestamp_seconds",
                                  "Wall time of the last good zone file read", registry=registry)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def load(self) -> None:
        """Read and apply the file now; raises :class:`ZoneFileError` on a bad file."""
        stamp = self._stat()
        data = read_zone_file(self.path)
        changed = apply_zone_data(self.store, data)
        self._stamp = stamp
        self.reloads.inc()
        self.last_success.set(time.time())
        logger.info("zone file %s: %d regions, %d projects, %d keys changed", self.path, len(data.regions),
                    len(data.projects), changed)

    def request_reload(self) -> None:
        """Ask for a re-read (the SIGHUP handler); safe to call from a signal handler."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_interval)
                forced = True
            except TimeoutError:
                forced = False
            self._wake.clear()
            if not forced and self._stat() == self._stamp:
                continue
            try:
                self.load()
            except ZoneFileError as exc:
                self.errors.inc()
                self._stamp = self._stat()  # do not retry the same bad content every poll
                logger.error("zone file refused, still serving the previous zone: %s", exc)
