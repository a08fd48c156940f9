"""Shared simulation state: the clock, the queues, the records and the emission log.

Workers read and change it; nothing else is global. Per-request work happens only at
arrival, admission, preemption and finish; per-round work is vectorised over the batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import simpy

from kestrel_sim.trace import RequestRecord, Span


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
        self, env: simpy.Environment, rng: np.random.Generator, records: list[RequestRecord],
        k: int, reserve: np.ndarray | None, progress: Callable[[int, int], None] | None,
    ):
        self.env = env
        self.rng = rng
        self.records = records
        self.k = k  # 0 without speculation
        self.reserve = reserve  # [n] KV charge per request under the `wait` policy, else None
        self.spans: list[Span] = []
        self.prefill_queue: deque[PrefillJob] = deque()
        self.decode_queue: deque[tuple[int, int, int]] = deque()  # (id, ctx, rem)
        self.ready_at = [0.0] * len(records)  # when each entered the decode queue
        self.prefill_workers: list = []  # workers that take from prefill_queue
        self.decode_workers: list = []  # workers that take from decode_queue
        self.em_time: list[float] = []  # one entry per emitting step
        self.em_ids: list[np.ndarray] = []  # [b] ids that gained tokens in that step
        self.em_count: list[np.ndarray] = []  # [b] tokens each gained
        self.done = 0
        self.preemptions = 0
        self.on_finish: Callable[[int], None] | None = None  # closed-loop clients
        self._progress = progress
        self._progress_every = max(1, len(records) // 200)
        self.all_done = env.event()

    # ------------------------------------------------------------------ arrivals

    def arrive(self, rid: int) -> None:
        rec = self.records[rid]
        rec.arrival = self.env.now
        self.prefill_queue.append(PrefillJob(rid, rec.prompt_tokens, rec.output_tokens))
        wake_one(self.prefill_workers)

    def requeue_preempted(self, rid: int, ctx: int, rem: int) -> None:
        """A preempted request goes to the front of the prefill queue to be recomputed."""
        self.records[rid].preemptions += 1
        self.preemptions += 1
        self.prefill_queue.appendleft(PrefillJob(rid, ctx, rem))
        wake_one(self.prefill_workers)

    # ------------------------------------------------------------------ emissions

    def emit(self, ids: np.ndarray, counts: np.ndarray) -> None:
        self.em_time.append(self.env.now)
        self.em_ids.append(ids)
        self.em_count.append(counts)

    def finish(self, rids) -> None:
        now = self.env.now
        records = self.records
        for rid in rids:
            records[rid].finish = now
            if self.on_finish is not None:
                self.on_finish(rid)
        self.done += len(rids)
        if self._progress is not None and (
            self.done % self._progress_every < len(rids) or self.done == len(records)
        ):
            self._progress(self.done, len(records))
        if self.done == len(records) and not self.all_done.triggered:
            self.all_done.succeed()

    def fill_emissions(self) -> None:
        """Write each record's emit_times / emit_counts / output_tokens from the log."""
        if not self.em_ids:
            return
        sizes = np.fromiter((len(a) for a in self.em_ids), dtype=np.int64, count=len(self.em_ids))
        ids = np.concatenate(self.em_ids)
        counts = np.concatenate(self.em_count)
        times = np.repeat(np.asarray(self.em_time), sizes)
        order = np.argsort(ids, kind="stable")  # chronological within each id
        ids, counts, times = ids[order], counts[order], times[order]
        bounds = np.searchsorted(ids, np.arange(len(self.records) + 1))
        tl, cl = times.tolist(), counts.tolist()
        for rid, rec in enumerate(self.records):
            lo, hi = bounds[rid], bounds[rid + 1]
            rec.emit_times = tl[lo:hi]
            rec.emit_counts = cl[lo:hi]
            rec.output_tokens = sum(rec.emit_counts)


def wake_one(workers: list) -> None:
    """Wake the first idle worker of a pool (busy ones look again at their next step)."""
    for w in workers:
        if w.wake is not None:
            ev, w.wake = w.wake, None
            ev.succeed()
            return
