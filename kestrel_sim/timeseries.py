"""Curves over one run, from a Recorder only (kept out of metrics.json; drawn in report.html
and as Perfetto counters).

The run is cut into bins from t = 0 of one width, the smallest power of two of seconds that
fits the run in at most MAX_BINS bins. Request counts are time averages over each bin, so
every request in the system at an instant is in exactly one of

    prefill_queue   arrived, not yet scheduled for prefill
    prefilling      prefill started, first token not yet out (disaggregated: with the KV
                    hand-over)
    decode_queue    first token out, not yet in a decode batch
    running         in a decode batch until it finishes

and they add up to in_system; sum(in_system) * bin_seconds is the sum of the requests'
latencies (Little's law, L = lambda W, over the run). A request counts in its first prefill
and first decode: after a preemption it stays `running` while it is recomputed.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict

from kestrel_sim.metrics import recorder_of
from kestrel_sim.recorder import Recorder
from kestrel_sim.trace import Trace

MAX_BINS = 256


class TimeSeries(BaseModel):
    """Curves over the run, one value per bin (kept out of metrics.json)."""

    model_config = ConfigDict(extra="forbid")

    bin_seconds: float  # width of every bin; bins start at t = 0
    time: list[float]  # s, bin centres
    prefill_queue: list[float]  # mean requests waiting for prefill
    prefilling: list[float]  # mean requests being prefilled (or handed over)
    decode_queue: list[float]  # mean requests past the first token, not yet decoding
    running: list[float]  # mean requests decoding
    in_system: list[float]  # mean requests arrived and not finished (the four above)
    output_throughput: list[float]  # output tokens/s in the bin
    request_throughput: list[float]  # completed requests/s in the bin


def bin_width(end: float) -> float:
    """The smallest power of two of seconds w with end < MAX_BINS * w."""
    if end <= 0:
        return 1.0
    _, exponent = math.frexp(end / MAX_BINS)  # end / MAX_BINS in [2**(e-1), 2**e)
    return math.ldexp(1.0, exponent)


def _time_in(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """[bins] request-seconds spent inside [start, end) within each bin (inf: never/not yet)."""

    def before(x: np.ndarray, points: np.ndarray) -> np.ndarray:
        # sum over points p < x of (x - p), for each x
        points = np.sort(points[np.isfinite(points)])
        prefix = np.concatenate(([0.0], np.cumsum(points)))
        n = np.searchsorted(points, x, side="right")
        return n * x - prefix[n]

    total = before(edges, starts) - before(edges, ends)
    return np.diff(total)


def timeseries_from(rec: Recorder) -> TimeSeries:
    """Queue lengths and throughputs over the run, bin by bin."""
    inf = np.inf

    def times(name: str) -> np.ndarray:
        values = rec.view(name)
        return np.where(np.isnan(values), inf, values)

    arrival = times("arrival")
    finish = times("finish_time")
    events = np.concatenate((arrival, finish, times("last_emit")))
    events = events[np.isfinite(events)]
    if events.size == 0:
        return TimeSeries(bin_seconds=1.0, time=[], prefill_queue=[], prefilling=[],
                          decode_queue=[], running=[], in_system=[], output_throughput=[],
                          request_throughput=[])
    end = float(events.max())
    width = max(bin_width(end), rec.tokens.width)
    bins = int(end // width) + 1  # the last event inside the last bin
    edges = np.arange(bins + 1) * width

    # each request's life cut at monotone boundaries, each clipped to its finish
    prefill = np.clip(times("prefill_start"), arrival, finish)
    first = np.clip(times("first_emit"), prefill, finish)
    decode = np.clip(times("decode_start"), first, finish)

    def mean_count(starts: np.ndarray, ends: np.ndarray) -> list[float]:
        return (_time_in(starts, ends, edges) / width).tolist()

    done, _ = np.histogram(finish[rec.completed()], bins=edges)
    return TimeSeries.model_construct(  # built here, plain Python values
        bin_seconds=width,
        time=((edges[:-1] + edges[1:]) / 2).tolist(),
        prefill_queue=mean_count(arrival, prefill),
        prefilling=mean_count(prefill, first),
        decode_queue=mean_count(first, decode),
        running=mean_count(decode, finish),
        in_system=mean_count(arrival, finish),
        output_throughput=(rec.tokens.coarse(width, bins) / width).tolist(),
        request_throughput=(done / width).tolist(),
    )


def compute_timeseries(trace: Trace) -> TimeSeries:
    """Time series of a run: a simulated run (its Recorder) or a whole Trace (replayed)."""
    return timeseries_from(recorder_of(trace))
