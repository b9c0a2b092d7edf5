"""Small builders shared by the health tests: views and copies with sensible defaults."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from region_agent.state.local import BindingStatus, CopyReason, CopyStatus, RegionView
from tests.conftest import wait_for

# tests.conftest.wait_for, typed loosely: its ``Callable[[], T | Awaitable[T]]`` parameter makes
# mypy (strict) infer ``Awaitable[Never]`` for async conditions. Same function, same deadlines.
wait_until: Callable[..., Awaitable[object]] = wait_for

REGION = "sfo1"
NOW = 1_800_000_000.0


def copy(slug: str, reason: CopyReason = CopyReason.OK, *, detail: str = "") -> CopyStatus:
    return CopyStatus(
        slug=slug, healthy=reason is CopyReason.OK, reason=reason, detail=detail,
        namespace=f"proj-{slug}", service=slug, revisions=(f"{slug}-00001",) if reason is CopyReason.OK else (),
    )


def view(
    copies: Iterable[CopyStatus] = (),
    *,
    synced: bool = True,
    bindings: tuple[BindingStatus, ...] = (),
    watch_errors: tuple[str, ...] = (),
    generated_at: float = NOW,
    region: str = REGION,
    degraded: tuple[str, ...] = (),
) -> RegionView:
    return RegionView(
        region=region, started_at=NOW - 100, generated_at=generated_at, synced=synced,
        synced_at=NOW - 90 if synced else None, last_event_at=NOW - 5, watch_errors=watch_errors,
        copies={c.slug: c for c in copies}, bindings=bindings, zone_serial=7, zone_digest="abc123",
        degraded=degraded,
    )


def many_copies(n: int) -> list[CopyStatus]:
    return [copy(f"p{i:05d}", CopyReason.OK if i % 10 else CopyReason.NO_READY_REVISION) for i in range(n)]
