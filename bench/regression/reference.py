"""The fixed reference workload the simulator's speed is measured against (a ruler).

A small discrete-event simulation in plain Python: a heap of timed events, a few queues,
dict and list bookkeeping and float arithmetic, as the simulator's own loop does, but none of
its code. A gate's number is (simulator seconds) / (reference seconds) measured in the same
process, interleaved, so a busy or slow CPU scales both and the ratio stays.

Never change this file: every baseline in bench/regression/baselines/sim_speed.json is a
ratio to it. A change here means re-recording all of them (and saying so in the commit).
"""

from __future__ import annotations

import heapq
import random

EVENTS = 60_000  # about 0.1 s on one 2020s x86 core


def reference_workload(events: int = EVENTS) -> float:
    """Run the reference; returns a checksum (so no step can be optimised away)."""
    rng = random.Random(12345)
    heap: list[tuple[float, int, int]] = []
    queues: dict[int, list[int]] = {q: [] for q in range(8)}
    busy: dict[int, float] = dict.fromkeys(range(8), 0.0)
    served = 0
    total = 0.0
    for i in range(64):
        heapq.heappush(heap, (rng.expovariate(1.0), i, rng.randrange(8)))
    n = 64
    while heap and served < events:
        now, job, q = heapq.heappop(heap)
        queue = queues[q]
        queue.append(job)
        if len(queue) >= 4 or rng.random() < 0.3:
            batch = queue[:16]
            del queue[:16]
            step = 0.001 * (1.0 + 0.05 * len(batch)) + sum(0.0001 * (j % 7) for j in batch)
            busy[q] += step
            total += step * len(batch)
            served += len(batch)
            for j in batch:
                if rng.random() < 0.9:
                    heapq.heappush(heap, (now + step + rng.expovariate(2.0), j, (q + j) % 8))
        if rng.random() < 0.5:
            heapq.heappush(heap, (now + rng.expovariate(1.0), n, rng.randrange(8)))
            n += 1
    return total + sum(busy.values()) + served
