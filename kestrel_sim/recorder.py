"""The Recorder: everything metrics and time series need, fed as a run goes.

One Recorder serves both sides. The simulator feeds it online (arrivals, prefill and decode
starts, emissions, finishes, spans) and keeps no trace it was not asked for; a Trace (the
runtime's, or one read from a file) is replayed through a fresh one by `replay`. Metrics
(`kestrel_sim.metrics`) and time series (`kestrel_sim.timeseries`) read only a Recorder, so
a simulated and a measured run are measured by the same code, and a run recorded online
and its full Trace replayed give the same numbers.

What it holds, apart from O(requests) arrays of scalars:
- per request (index i; the simulator's request id, or the position in trace.requests):
  arrival, prompt tokens, first prefill and decode start, first and last emission, finish,
  emissions, output tokens, preemptions;
- the gaps between one request's emissions (tallies.ITLGaps: exact up to a bound);
- output tokens over time (tallies.TokenBins);
- per worker: busy seconds and seconds per stage (tallies.WorkerTally);
- speculative rounds: drafts (a request in one verify), draft tokens, and a count of rounds
  per number of accepted draft tokens (the tokens kept: a request near its end keeps fewer).
"""

from __future__ import annotations

import math
from itertools import chain

import numpy as np

from kestrel_sim.errors import KestrelError
from kestrel_sim.tallies import ITLGaps, TokenBins, WorkerTally
from kestrel_sim.trace import Trace

PER_REQUEST = ("arrival", "prefill_start", "decode_start", "first_emit", "last_emit",
               "finish_time", "prompt", "emits", "output", "preemptions")


class Recorder:
    """Fed events by request index; `close()` once the run is over (spans buffered per
    worker are accounted for then). Times are seconds from the start of the run; NaN in a
    time array means "not yet"."""

    def __init__(self, capacity: int = 1024):
        n = max(1, capacity)  # arrays grow past it as needed
        self.arrival = np.full(n, np.nan)  # [n] s
        self.prefill_start = np.full(n, np.nan)  # [n] s, first scheduled for prefill
        self.decode_start = np.full(n, np.nan)  # [n] s, first in a decode batch
        self.first_emit = np.full(n, np.nan)  # [n] s, the first token
        self.last_emit = np.full(n, np.nan)  # [n] s, the latest emission
        self.finish_time = np.full(n, np.nan)  # [n] s
        self.prompt = np.zeros(n, dtype=np.int64)  # [n] prompt tokens
        self.emits = np.zeros(n, dtype=np.int64)  # [n] emissions
        self.output = np.zeros(n, dtype=np.int64)  # [n] output tokens emitted
        self.preemptions = np.zeros(n, dtype=np.int64)  # [n]
        self.count = 0  # requests seen (highest index + 1)
        self.itl = ITLGaps()
        self.tokens = TokenBins()
        self.workers: dict[str, WorkerTally] = {}
        self.drafts = 0  # (request, verify round) pairs
        self.draft_tokens = 0
        self.accepted_hist = np.zeros(1, dtype=np.int64)  # [n]: rounds keeping n drafts
        self.k = 0  # the most draft tokens proposed in a round
        self.spans_seen = 0

    # ------------------------------------------------------------------ requests

    def _room(self, index: int) -> None:
        size = self.arrival.size
        if index >= size:
            new = max(index + 1, 2 * size)
            for name in PER_REQUEST:
                old = getattr(self, name)
                grown = np.full(new, np.nan) if old.dtype.kind == "f" else np.zeros(new, old.dtype)
                grown[:size] = old
                setattr(self, name, grown)
        self.count = max(self.count, index + 1)

    def arrive(self, i: int, t: float, prompt_tokens: int) -> None:
        self._room(i)
        self.arrival[i] = t
        self.prompt[i] = prompt_tokens

    def start_prefill(self, i: int, t: float) -> bool:
        """Record request i's first prefill start; True if this was it."""
        if math.isnan(self.prefill_start[i]):
            self.prefill_start[i] = t
            return True
        return False

    def start_decode(self, i: int, t: float) -> bool:
        """Record request i's first decode start; True if this was it."""
        if math.isnan(self.decode_start[i]):
            self.decode_start[i] = t
            return True
        return False

    def preempt(self, i: int) -> None:
        self.preemptions[i] += 1

    def finish(self, index, t: float) -> None:
        """Requests `index` (ints) finished at t."""
        self.finish_time[np.asarray(index, dtype=np.int64)] = t

    # ------------------------------------------------------------------ emissions

    def emit(self, index: np.ndarray, times: np.ndarray, counts: np.ndarray) -> None:
        """Emissions ([m] request index, [m] time, [m] tokens), in time order within one
        request (any order across requests), each after its request's earlier ones."""
        if index.size == 0:
            return
        order = np.argsort(index, kind="stable")
        index, times, counts = index[order], times[order], counts[order]
        head = np.ones(index.size, dtype=bool)  # [m] first entry of its request here
        head[1:] = index[1:] != index[:-1]
        starts = np.flatnonzero(head)
        ends = np.append(starts[1:], index.size)
        who = index[starts]
        prev = np.empty_like(times)  # [m] the request's emission before this one
        prev[1:] = times[:-1]
        prev[starts] = self.last_emit[who]
        first = np.isnan(prev)
        self.first_emit[index[first]] = times[first]
        self.last_emit[who] = times[ends - 1]
        self.emits[who] += ends - starts
        self.output[who] += np.add.reduceat(counts, starts)
        gap = ~first
        self.itl.add(index[gap], times[gap] - prev[gap])
        self.tokens.add(times, counts.astype(float))

    # ------------------------------------------------------------------ spans

    def spans(self, spans: list) -> None:
        """Spans, each worker's in start order; queue waits occupy no worker."""
        workers = self.workers
        accepted: list[list[int]] = []
        drafts = self.drafts
        for s in spans:
            kind = s.kind
            if kind == "queue_wait":
                continue
            if kind == "verify" and s.accepted:
                accepted.append(s.accepted)
                self.drafts += len(s.accepted)
                self.draft_tokens += s.proposed * len(s.accepted)
                self.k = max(self.k, s.proposed)
            tally = workers.get(s.worker)
            if tally is None:
                tally = workers[s.worker] = WorkerTally()
            start, end = s.start, s.end
            if start == tally.start and end == tally.end:
                tally.add(s)  # the same forward: a mixed step
            else:  # WorkerTally.add, inlined for the common case
                tally.close()
                tally.start, tally.end, tally.first = start, end, s
        self.spans_seen += len(spans)
        if accepted:
            values = np.fromiter(chain.from_iterable(accepted), dtype=np.int64,
                                 count=self.drafts - drafts)
            hist = np.bincount(values)
            if hist.size > self.accepted_hist.size:
                hist[: self.accepted_hist.size] += self.accepted_hist
                self.accepted_hist = hist
            else:
                self.accepted_hist[: hist.size] += hist

    def close(self) -> None:
        for tally in self.workers.values():
            tally.close()

    # ------------------------------------------------------------------ views

    def view(self, name: str) -> np.ndarray:
        """[count] one per-request array (a view)."""
        return getattr(self, name)[: self.count]

    def completed(self) -> np.ndarray:
        """[count] bool: finished after emitting at least one token."""
        return ~np.isnan(self.view("finish_time")) & (self.view("emits") > 0)


def replay(trace: Trace) -> Recorder:
    """A Recorder fed from a whole Trace (the runtime's, or one read from a file): the
    requests, their emissions, then the spans in start order (stable, so each worker's
    spans keep their order). A Trace that kept only part of its run is refused."""
    kept = trace.meta.get("trace") if isinstance(trace.meta, dict) else None
    if isinstance(kept, dict) and not kept.get("complete", True):
        raise KestrelError(
            f"this Trace keeps only part of its run (trace mode '{kept.get('mode')}': "
            f"{kept.get('spans_kept')} of {kept.get('spans_seen')} spans): metrics and time "
            "series need every request and span. Read them from the metrics.json and "
            "timeseries.json written with it, or run again with the trace kept in full"
        )
    reqs = trace.requests
    rec = Recorder(len(reqs))
    for i, r in enumerate(reqs):
        rec.arrive(i, r.arrival, r.prompt_tokens)
        for name, array in (("prefill_start", rec.prefill_start),
                            ("decode_start", rec.decode_start), ("finish", rec.finish_time)):
            value = getattr(r, name)
            if value is not None:
                array[i] = value
        rec.preemptions[i] = r.preemptions
    sizes = np.fromiter((len(r.emit_times) for r in reqs), dtype=np.int64, count=len(reqs))
    total = int(sizes.sum())
    if total:
        index = np.repeat(np.arange(len(reqs), dtype=np.int64), sizes)
        times = np.fromiter(chain.from_iterable(r.emit_times for r in reqs), float, count=total)
        counts = np.fromiter(chain.from_iterable(r.emit_counts for r in reqs), np.int64,
                             count=total)
        rec.emit(index, times, counts)
    rec.spans(sorted(trace.spans, key=lambda s: s.start))
    rec.close()
    return rec
