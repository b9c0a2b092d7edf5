"""The informer's store: key → slim record, and the events that changing it produces.

Pure and synchronous, so the delicate parts of an informer — "a relist emits DELETED for
objects that vanished", "an event that changes nothing the agent keeps emits nothing" — are
tested as tables without a server. The mutating methods (``apply``, ``replace``) belong to the
informer; readers get :attr:`Cache.view`, a read-only mapping that always shows the current
contents.

Events compare *slim records*: a MODIFIED that only touched fields the agent does not keep
(managedFields, unrelated annotations, ...) is swallowed, which keeps consumers quiet when the
apiserver is busy with things that do not matter here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

EventType = Literal["ADDED", "MODIFIED", "DELETED"]


@dataclass(frozen=True, slots=True)
class WatchEvent(Generic[T]):
    """One change of the cache, in the order it was applied.

    ``obj`` is the new record (for DELETED: the final state sent by the apiserver, or the last
    known record when the deletion was inferred from a relist). ``old`` is the record the
    cache held before (None for ADDED). ``final_state_unknown`` marks a DELETED synthesised by a
    relist: the object vanished while the watch was down, and how it ended is not known.
    """

    type: EventType
    key: str
    obj: T
    old: T | None = None
    final_state_unknown: bool = False


class Cache(Generic[T]):
    def __init__(self) -> None:
        self._items: dict[str, T] = {}
        self.view: Mapping[str, T] = MappingProxyType(self._items)

    def __len__(self) -> int:
        return len(self._items)

    # Informer's internal protocol: not for readers.

    def apply(self, event_type: EventType, key: str, record: T) -> WatchEvent[T] | None:
        """Apply one watch event; return what changed, or None when nothing did."""
        old = self._items.get(key)
        if event_type == "DELETED":
            if old is None:
                return None
            del self._items[key]
            return WatchEvent("DELETED", key, record, old)
        self._items[key] = record
        if old is None:
            return WatchEvent("ADDED", key, record)
        if old == record:
            return None
        return WatchEvent("MODIFIED", key, record, old)

    def replace(self, records: Mapping[str, T]) -> list[WatchEvent[T]]:
        """Make the cache equal ``records`` (a full LIST); deletions first, then additions/changes."""
        events: list[WatchEvent[T]] = []
        for key in [k for k in self._items if k not in records]:
            old = self._items.pop(key)
            events.append(WatchEvent("DELETED", key, old, old, final_state_unknown=True))
        for key, record in records.items():
            change = self.apply("MODIFIED", key, record)
            if change is not None:
                events.append(change)
        return events
