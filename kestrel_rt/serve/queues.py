"""The engine's two queues, as the simulator's: prefill jobs (FIFO; a preempted request goes
back to the front) and the disaggregated decode queue (fifo, or shortest-first: fewest
tokens in the sequence first, ties in arrival order at the queue).

Admission from either takes the head only while it fits: the head blocks the rest.
"""

from __future__ import annotations

import heapq
from itertools import count

from kestrel_rt.serve.requests import Sequence


class PrefillJob:
    """A prompt (or, after a preemption, prompt + generated tokens) being prefilled."""

    __slots__ = ("done", "need", "seq")

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.need = seq.ctx  # tokens to prefill
        self.done = 0  # tokens prefilled so far

    @property
    def rid(self) -> int:
        return self.seq.rid


class DecodeQueue:
    """Prefilled requests whose KV reached the decode worker, waiting for its batch."""

    def __init__(self, order: str = "fifo"):
        if order not in ("fifo", "shortest-first"):
            raise ValueError(f"decode queue order '{order}': expected fifo or shortest-first")
        self.order = order
        self.items: list[tuple[int, int, Sequence]] = []  # heap of (key, entry no., seq)
        self.entries = count()

    def __len__(self) -> int:
        return len(self.items)

    def push(self, seq: Sequence) -> None:
        n = next(self.entries)
        heapq.heappush(self.items, (seq.ctx if self.order == "shortest-first" else n, n, seq))

    def peek(self) -> Sequence:
        return self.items[0][2]

    def pop(self) -> Sequence:
        return heapq.heappop(self.items)[2]
