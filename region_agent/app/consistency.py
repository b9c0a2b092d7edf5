"""Rules across keys that no single write can check: a project naming a region that is not configured.

The control API refuses a project naming an unknown region, but the region may be deleted later, at
another agent, or arrive after the project by gossip. The zone leaves such a region out of the
project's answers (a silent NODATA if it was the only one); this makes it a visible problem instead:
one line per project in ``/health/region`` (the operator's), and the gauge
``region_agent_state_projects_missing_regions``. Kept up to date from store changes, not by a scan
per look (10,000 projects), and a region change re-checks every project once.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from region_agent.state.model import Kind
from region_agent.state.store import Entry, Store

MAX_LINES = 20   # problem lines shown; the gauge counts them all


class MissingRegions:
    def __init__(self, store: Store, registry: CollectorRegistry) -> None:
        self.store = store
        self.missing: dict[str, tuple[str, ...]] = {}
        self._gauge = Gauge("region_agent_state_projects_missing_regions",
                            "Projects naming a region that is not configured (left out of their answers)",
                            registry=registry)
        self._gauge.set_function(lambda: len(self.missing))
        store.subscribe(self._on_change)
        self._check_all()

    def _check(self, slug: str) -> None:
        project = self.store.projects.get(slug)
        regions = self.store.regions
        missing = () if project is None else tuple(r for r in project.regions if r not in regions)
        if missing:
            self.missing[slug] = missing
        else:
            self.missing.pop(slug, None)

    def _check_all(self) -> None:
        self.missing.clear()
        for slug in self.store.projects:
            self._check(slug)

    def _on_change(self, changes: list[Entry]) -> None:
        if any(e.key[0] == Kind.REGION.value for e in changes):
            self._check_all()
            return
        for entry in changes:
            if entry.key[0] == Kind.PROJECT.value:
                self._check(entry.key[1])

    def problems(self) -> tuple[str, ...]:
        lines = [f"project {slug} names region(s) {', '.join(regions)} that are not configured: left out of its "
                 "answers" for slug, regions in sorted(self.missing.items())[:MAX_LINES]]
        if len(self.missing) > MAX_LINES:
            lines.append(f"... and {len(self.missing) - MAX_LINES} more projects naming unconfigured regions")
        return tuple(lines)
