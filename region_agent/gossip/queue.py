"""Transmit-limited broadcast queue: what this node still has to tell others, piggybacked on packets.

Each queued message is sent at most ``limit`` times (``retransmit_mult * ceil(log10(N + 1))``),
least-sent first, so fresh news overtakes old news. A newer message with the same key (the same
member, the same user broadcast) replaces the queued one: nobody needs an outdated alive.

The queue is bounded (``max_items``): past it the most-sent items go first (they are the most
widely known already), so a burst of news costs bounded memory and bounded work per packet;
anti-entropy repairs whatever a dropped broadcast would have told.
"""

from __future__ import annotations

from dataclasses import dataclass

# A compound datagram: version, type and count bytes, then a two-byte length before each part.
COMPOUND_HEADER = 3
PART_OVERHEAD = 2


@dataclass(slots=True)
class _Item:
    key: str
    payload: bytes
    order: int
    transmits: int = 0


class BroadcastQueue:
    def __init__(self, max_items: int = 4096) -> None:
        self._items: dict[str, _Item] = {}
        self._order = 0
        self.max_items = max_items
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def queue(self, key: str, payload: bytes) -> None:
        self._order += 1
        self._items[key] = _Item(key, payload, self._order)
        if len(self._items) > self.max_items:
            # Drop to 90 % at once (one sort per burst, not per item): most sent first, oldest among equals.
            keep = self.max_items * 9 // 10
            ranked = sorted(self._items.values(), key=lambda i: (-i.transmits, i.order))
            for item in ranked[:len(self._items) - keep]:
                if item.key != key:
                    del self._items[item.key]
                    self.dropped += 1

    def take(self, budget: int, limit: int, max_parts: int) -> list[bytes]:
        """Payloads that fit in ``budget`` bytes of compound parts (overhead counted), least sent first;
        each taken one counts a transmission and leaves the queue after ``limit`` of them."""
        if not self._items or budget <= PART_OVERHEAD:
            return []
        taken: list[bytes] = []
        # Least transmitted first; among equals the newest first (it is the least known).
        for item in sorted(self._items.values(), key=lambda i: (i.transmits, -i.order)):
            if len(taken) >= max_parts:
                break
            cost = len(item.payload) + PART_OVERHEAD
            if cost > budget:
                continue
            budget -= cost
            taken.append(item.payload)
            item.transmits += 1
            if item.transmits >= limit:
                del self._items[item.key]
        return taken

    def transmits(self, key: str) -> int | None:
        item = self._items.get(key)
        return None if item is None else item.transmits
