"""Cache semantics as tables: what each apply/replace emits."""

from __future__ import annotations

import pytest

from region_agent.kube.cache import Cache, WatchEvent


def cache_with(**items: str) -> Cache[str]:
    cache: Cache[str] = Cache()
    cache.replace(items)
    return cache


@pytest.mark.parametrize(
    ("start", "event_type", "key", "record", "expected", "after"),
    [
        ({}, "ADDED", "a", "1", WatchEvent("ADDED", "a", "1"), {"a": "1"}),
        ({"a": "1"}, "ADDED", "a", "2", WatchEvent("MODIFIED", "a", "2", "1"), {"a": "2"}),  # replayed ADDED
        ({"a": "1"}, "MODIFIED", "a", "2", WatchEvent("MODIFIED", "a", "2", "1"), {"a": "2"}),
        ({"a": "1"}, "MODIFIED", "a", "1", None, {"a": "1"}),  # nothing the agent keeps changed
        ({}, "MODIFIED", "a", "1", WatchEvent("ADDED", "a", "1"), {"a": "1"}),  # entered the selector
        ({"a": "1"}, "DELETED", "a", "9", WatchEvent("DELETED", "a", "9", "1"), {}),
        ({}, "DELETED", "a", "9", None, {}),  # never seen: nothing to tell
    ],
)
def test_apply(
    start: dict[str, str],
    event_type: str,
    key: str,
    record: str,
    expected: WatchEvent[str] | None,
    after: dict[str, str],
) -> None:
    cache = cache_with(**start)
    assert cache.apply(event_type, key, record) == expected  # type: ignore[arg-type]
    assert dict(cache.view) == after


def test_replace_synthesises_deletions_first_then_changes() -> None:
    cache = cache_with(a="1", b="1", c="1")
    events = cache.replace({"b": "1", "c": "2", "d": "1"})
    assert events == [
        WatchEvent("DELETED", "a", "1", "1", final_state_unknown=True),
        WatchEvent("MODIFIED", "c", "2", "1"),
        WatchEvent("ADDED", "d", "1"),
    ]
    assert dict(cache.view) == {"b": "1", "c": "2", "d": "1"}


def test_view_is_read_only_and_live() -> None:
    cache = cache_with(a="1")
    view = cache.view
    with pytest.raises(TypeError):
        view["b"] = "2"  # type: ignore[index]
    cache.apply("ADDED", "b", "2")
    assert set(view) == {"a", "b"} and len(cache) == 2
