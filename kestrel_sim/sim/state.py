"""Shared simulation state: the clock, the queues, the Recorder and the buffers feeding it.

Workers read and change it; nothing else is global. Per-request work happens only at
arrival, admission, preemption and finish; per-round work is vectorised over the batch.
Spans and emissions are buffered and handed to the Recorder (every event, for metrics) and
the TraceKeeper (what the Trace keeps) in chunks of about FLUSH_EVERY, so memory stays
bounded however long the run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import simpy

from kestrel_sim.recorder import Recorder
from kestrel_sim.sim.keep import TraceKeeper
from kestrel_sim.trace import Span

FLUSH_EVERY = 1 << 16  # buffered spans, or emissions, before they go to the Recorder


class PrefillJob:
    """A prompt (or, after a preemption, prompt + emitted tokens) being prefilled."""

    __slots__ = ("done", "need", "rem", "rid")

    def __init__(self, rid: int, need: int, rem: int):
        self.rid = rid
        self.need = need  # tokens to prefill
        self.done = 0  # tokens prefilled so far
        self.rem = rem  # output tokens still to emit


class SimState:
    def __init__(
        self, env: simpy.Environment, rng: np.random.Generator, prompts: list[int],
        outputs: list[int], k: int, reserve: np.ndarray | None, keeper: TraceKeeper,
        progress: Callable[[int, int], None] | None = None,
    ):
        n = len(prompts)
        self.env = env
        self.rng = rng
        self.prompts, self.outputs = prompts, outputs  # [n] drawn lengths
        self.n = n
        self.k = k  # 0 without speculation
        self.reserve = reserve  # [n] KV charge per request under the `wait` policy, else None
        self.rec = Recorder(n)
        self.keeper = keeper
        self.spans: list[Span] = []  # buffered; flush() hands them on
        self.prefill_queue: deque[PrefillJob] = deque()
        self.ready_at = np.zeros(n)  # when each entered a decode worker's queue
        self.prefill_workers: list = []  # workers that take from prefill_queue
        self.decode_workers: list = []  # workers that take from their own decode queue
        self.handover = None  # disaggregated: the KV Handover (handover.py)
        self.em_time: list[float] = []  # one entry per emitting step
        self.em_ids: list[np.ndarray] = []  # [b] ids that gained tokens in that step
        self.em_count: list[np.ndarray] = []  # [b] tokens each gained
        self.em_buffered = 0
        self.done = 0
        self.preemptions = 0
        self.on_finish: Callable[[int], None] | None = None  # closed-loop clients
        self._progress = progress
        self._progress_every = max(1, n // 200)
        self.all_done = env.event()

    # ------------------------------------------------------------------ arrivals

    def arrive(self, rid: int) -> None:
        self.rec.arrive(rid, self.env.now, self.prompts[rid])
        self.prefill_queue.append(PrefillJob(rid, self.prompts[rid], self.outputs[rid]))
        wake_one(self.prefill_workers)

    def requeue_preempted(self, rid: int, ctx: int, rem: int) -> None:
        """A preempted request goes to the front of the prefill queue to be recomputed."""
        self.rec.preempt(rid)
        self.preemptions += 1
        self.prefill_queue.appendleft(PrefillJob(rid, ctx, rem))
        wake_one(self.prefill_workers)

    # ------------------------------------------------------------------ emissions

    def emit(self, ids: np.ndarray, counts: np.ndarray) -> None:
        self.em_time.append(self.env.now)
        self.em_ids.append(ids)
        self.em_count.append(counts)
        self.em_buffered += len(ids)
        if self.em_buffered >= FLUSH_EVERY or len(self.spans) >= FLUSH_EVERY:
            self.flush()

    def finish(self, rids) -> None:
        self.rec.finish(rids, self.env.now)
        if self.on_finish is not None:
            for rid in rids:
                self.on_finish(rid)
        self.done += len(rids)
        n = self.n
        if self._progress is not None and (
            self.done % self._progress_every < len(rids) or self.done == n
        ):
            self._progress(self.done, n)
        if self.done == n and not self.all_done.triggered:
            self.all_done.succeed()

    def flush(self) -> None:
        """Hand the buffered spans and emissions to the Recorder and the TraceKeeper."""
        spans = list(self.spans)
        self.spans.clear()  # in place: a step holding the list still appends to it
        self.rec.spans(spans)
        self.keeper.add_spans(spans)
        if self.em_ids:
            sizes = np.fromiter((len(a) for a in self.em_ids), dtype=np.int64,
                                count=len(self.em_ids))
            ids = np.concatenate(self.em_ids)
            counts = np.concatenate(self.em_count)
            times = np.repeat(np.asarray(self.em_time), sizes)
            self.em_time, self.em_ids, self.em_count, self.em_buffered = [], [], [], 0
            self.rec.emit(ids, times, counts)
            self.keeper.add_emissions(ids, times, counts, self.rec.arrival[ids])


def wake_one(workers: list) -> None:
    """Wake the first idle worker of a pool (busy ones look again at their next step)."""
    for w in workers:
        if w.wake is not None:
            ev, w.wake = w.wake, None
            ev.succeed()
            return
