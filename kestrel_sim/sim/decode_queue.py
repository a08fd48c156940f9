"""The disaggregated decode queue: prefilled requests whose KV reached the decode side, in
`fifo` order or `shortest-first` (fewest tokens in the sequence first, ties in the order they
joined the queue), a priority queue as nano-vllm's. Workers take the head only while it fits
(the head blocks the rest)."""

from __future__ import annotations

import heapq
from itertools import count


class DecodeQueue:
    __slots__ = ("entries", "heap", "shortest_first")

    def __init__(self, order: str = "fifo"):
        self.shortest_first = order == "shortest-first"
        self.heap: list[tuple[int, int, tuple[int, int, int]]] = []  # (key, entry no., job)
        self.entries = count()

    def __len__(self) -> int:
        return len(self.heap)

    def push(self, rid: int, ctx: int, rem: int) -> None:
        n = next(self.entries)
        heapq.heappush(self.heap, (ctx if self.shortest_first else n, n, (rid, ctx, rem)))

    def head(self) -> tuple[int, int, int]:
        """(id, ctx, rem) of the next request."""
        return self.heap[0][2]

    def pop(self) -> tuple[int, int, int]:
        return heapq.heappop(self.heap)[2]
