"""When requests reach the engine, in wall-clock seconds since the run started.

Open loop (Poisson, gamma, replay): at the drawn times, whatever the engine is doing.
Closed loop (as the simulator's processes.closed_loop): `concurrency` clients send at time
0; each finish sends the next request `think_time_s` later. A request that arrives during
a step is seen by the scheduler at the step's end, but its record keeps the time it was
sent, so its queueing shows in TTFT as on a real server.
"""

from __future__ import annotations

import heapq

from kestrel_sim.workload import DrawnWorkload


class Arrivals:
    def __init__(self, drawn: DrawnWorkload):
        self.n = drawn.n
        self.think = drawn.think_time_s
        if drawn.arrivals is None:  # closed loop
            first = min(drawn.concurrency, self.n)
            self.pending = [(0.0, rid) for rid in range(first)]  # heap of (time, id)
            self.next_rid = first
        else:
            self.pending = [(float(t), rid) for rid, t in enumerate(drawn.arrivals)]
            self.next_rid = self.n
        heapq.heapify(self.pending)

    def due(self, now: float) -> list[tuple[int, float]]:
        """(id, arrival time) of the requests sent by `now`, in time order."""
        out = []
        while self.pending and self.pending[0][0] <= now:
            t, rid = heapq.heappop(self.pending)
            out.append((rid, t))
        return out

    def next_time(self) -> float | None:
        return self.pending[0][0] if self.pending else None

    def finished(self, now: float) -> None:
        """A request finished at `now`: a closed-loop client sends its next one."""
        if self.next_rid < self.n:
            heapq.heappush(self.pending, (now + self.think, self.next_rid))
            self.next_rid += 1
