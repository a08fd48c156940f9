"""Bounded accumulators the Recorder keeps: inter-token gaps, output tokens over time, and
each worker's busy time by stage.

Every one gives the same answer whatever order its input comes in (integer counts, exact
differences, values sorted before use), so a run recorded as it goes and the same run replayed
from its Trace agree exactly. The exception is documented where it is: the running sums of
the gaps once they are past ITL_EXACT_LIMIT.
"""

from __future__ import annotations

import math

import numpy as np

ITL_EXACT_LIMIT = 1_000_000  # gaps kept one by one (16 MB); past it, a histogram
ITL_HIST_MIN = 1e-7  # s: the histogram's first edge (smaller gaps land in bin 0)
ITL_HIST_RATIO = 1.001  # each bin 0.1% wider than the last: quantiles within 0.05%
ITL_HIST_BINS = 27_700  # up to 1e-7 * 1.001**27_699 ~ 1.1e5 s
TOKEN_BINS = 4096  # output tokens over time: bins from t = 0, their width doubling as needed
TOKEN_BIN_FIRST_WIDTH = 2.0**-20  # s (about 1 us)


class ITLGaps:
    """Gaps between successive emissions of one request (s), with the request's index.

    Up to ITL_EXACT_LIMIT gaps all are kept, as vLLM keeps its per-request `itls`; past that
    they go into a log-spaced histogram (bins ITL_HIST_RATIO wide) plus running sums, so a
    run of any length holds a fixed amount. `exact()` returns the kept gaps or None."""

    __slots__ = ("chunks", "count", "hist", "sum", "sumsq")

    def __init__(self):
        self.chunks: list[tuple[np.ndarray, np.ndarray]] = []  # ([m] index, [m] gap s)
        self.count = 0
        self.hist: np.ndarray | None = None  # [ITL_HIST_BINS] counts once past the limit
        self.sum = 0.0  # sums of gaps and squared gaps, kept once past the limit (their
        self.sumsq = 0.0  # rounding depends on the order gaps arrive in: ~1e-16 relative)

    def add(self, index: np.ndarray, gaps: np.ndarray) -> None:
        if gaps.size == 0:
            return
        self.count += gaps.size
        if self.hist is None:
            self.chunks.append((index, gaps))
            if self.count > ITL_EXACT_LIMIT:
                self.hist = np.zeros(ITL_HIST_BINS, dtype=np.int64)
                for _, g in self.chunks:
                    self._bin(g)
                self.chunks = []
        else:
            self._bin(gaps)

    def _bin(self, gaps: np.ndarray) -> None:
        with np.errstate(divide="ignore"):
            pos = np.log(np.maximum(gaps, 0.0) / ITL_HIST_MIN) / math.log(ITL_HIST_RATIO)
        idx = np.clip(np.floor(pos) + 1, 0, ITL_HIST_BINS - 1).astype(np.int64)
        self.hist += np.bincount(idx, minlength=ITL_HIST_BINS)
        self.sum += float(gaps.sum())
        self.sumsq += float(np.dot(gaps, gaps))

    def exact(self) -> tuple[np.ndarray, np.ndarray] | None:
        """All gaps ([m] request index, [m] s), by request, in time order within one; None
        once past the limit."""
        if self.hist is not None:
            return None
        if not self.chunks:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        index = np.concatenate([c[0] for c in self.chunks])
        gaps = np.concatenate([c[1] for c in self.chunks])
        order = np.argsort(index, kind="stable")  # chunks arrive in time order
        return index[order], gaps[order]

    def hist_quantile(self, q: float) -> float:
        """The q-quantile (0..1) of the histogram, linear between order statistics as
        numpy's percentile; each order statistic is its bin's geometric centre."""
        cum = np.cumsum(self.hist)
        rank = q * (cum[-1] - 1)
        lo, hi = math.floor(rank), math.ceil(rank)

        def value(r: int) -> float:
            b = int(np.searchsorted(cum, r, side="right"))
            return 0.0 if b == 0 else ITL_HIST_MIN * ITL_HIST_RATIO ** (b - 0.5)

        v_lo = value(lo)
        return v_lo + (rank - lo) * (value(hi) - v_lo)


class TokenBins:
    """Output tokens per time bin from t = 0: TOKEN_BINS bins whose width doubles (pairs of
    bins merge) whenever a time falls past the last one, so the counts depend only on the
    times seen, not their order. Also tokens per whole second, for the peak rate."""

    __slots__ = ("counts", "per_second", "width")

    def __init__(self):
        self.width = TOKEN_BIN_FIRST_WIDTH
        self.counts = np.zeros(TOKEN_BINS)
        self.per_second = np.zeros(0)

    def add(self, times: np.ndarray, counts: np.ndarray) -> None:
        times = np.maximum(times, 0.0)
        top = float(times.max())
        while top >= self.width * TOKEN_BINS:
            merged = self.counts.reshape(-1, 2).sum(axis=1)
            self.counts = np.concatenate((merged, np.zeros(TOKEN_BINS - merged.size)))
            self.width *= 2.0
        self.counts += np.bincount((times / self.width).astype(np.int64), weights=counts,
                                   minlength=TOKEN_BINS)
        seconds = np.bincount(times.astype(np.int64), weights=counts)
        if seconds.size > self.per_second.size:
            seconds[: self.per_second.size] += self.per_second
            self.per_second = seconds
        else:
            self.per_second[: seconds.size] += seconds

    def coarse(self, width: float, bins: int) -> np.ndarray:
        """[bins] tokens per bin of `width` (a power-of-two multiple of self.width)."""
        factor = max(1, round(width / self.width))
        n = -(-self.counts.size // factor) * factor
        padded = np.zeros(max(n, bins * factor))
        padded[: self.counts.size] = self.counts
        return padded.reshape(-1, factor).sum(axis=1)[:bins]


class WorkerTally:
    """One worker's busy seconds (the union of its spans) and seconds per stage.

    Spans come in start order. Spans with the same start and end are one forward (a mixed
    step: a decode or verify carrying a prefill chunk): its seconds are split among them in
    proportion to their tokens, so the stages of a worker add up to its busy time."""

    __slots__ = ("busy", "end", "first", "more", "reach", "seconds", "start")

    def __init__(self):
        self.busy = 0.0
        self.reach = -math.inf  # the latest end so far
        self.start = self.end = math.nan  # the open forward ...
        self.first = None  # ... its first span
        self.more: list | None = None  # ... and any others (a mixed step)
        self.seconds: dict[str, float] = {}

    def add(self, span) -> None:
        """The next span of this worker (Recorder.spans inlines this)."""
        if span.start == self.start and span.end == self.end:
            if self.more is None:
                self.more = [span]
            else:
                self.more.append(span)
            return
        self.close()
        self.start, self.end, self.first = span.start, span.end, span

    def close(self) -> None:
        """Account for the open forward."""
        first = self.first
        if first is None:
            return
        start, end = self.start, self.end
        lo = max(self.reach, start)
        if end > lo:  # only what lies beyond everything before counts as busy
            self.busy += end - lo
            self.reach = end
        dur = end - start
        seconds = self.seconds
        if self.more is None:
            seconds[first.kind] = seconds.get(first.kind, 0.0) + dur
        else:
            group = [first, *self.more]
            tokens = sum(s.tokens for s in group)
            for s in group:
                share = s.tokens / tokens if tokens else 1.0 / len(group)
                seconds[s.kind] = seconds.get(s.kind, 0.0) + dur * share
            self.more = None
        self.first = None
