"""Curves over one run, from a Trace only: queue lengths and throughput per time bin
(kept out of metrics.json; drawn in report.html and as Perfetto counters)."""

from __future__ import annotations

from itertools import chain

import numpy as np
from pydantic import BaseModel, ConfigDict

from kestrel_sim.metrics import run_window
from kestrel_sim.trace import Trace


class TimeSeries(BaseModel):
    """Sampled curves over the run: queue lengths and throughput (kept out of metrics.json)."""

    model_config = ConfigDict(extra="forbid")

    time: list[float]  # s, bin centres
    prefill_queue: list[float]  # requests arrived, not yet scheduled for prefill
    decode_queue: list[float]  # past the first token, not yet decoding
    running: list[float]  # requests decoding (decode start .. finish)
    output_throughput: list[float]  # output tokens/s in the bin
    request_throughput: list[float]  # completed requests/s in the bin


def _occupancy(starts: np.ndarray, ends: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Number of intervals [start, end) containing each time in `t`."""
    s = np.sort(starts)
    e = np.sort(ends)
    return (np.searchsorted(s, t, side="right") - np.searchsorted(e, t, side="right")).astype(float)


def compute_timeseries(trace: Trace, bins: int = 200) -> TimeSeries:
    """Queue lengths (sampled at bin centres) and throughputs (per bin) over the run."""
    reqs = trace.requests
    start, end = run_window(trace)
    if end <= start or not reqs:
        return TimeSeries(time=[], prefill_queue=[], decode_queue=[], running=[],
                          output_throughput=[], request_throughput=[])
    edges = np.linspace(start, end, bins + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    width = edges[1] - edges[0]
    inf = np.inf

    def col(get) -> np.ndarray:
        return np.array([inf if (v := get(r)) is None else v for r in reqs], dtype=float)

    arrival = col(lambda r: r.arrival)
    prefill_start = col(lambda r: r.prefill_start)
    first = col(lambda r: r.first_token)
    decode_start = col(lambda r: r.decode_start)
    finish = col(lambda r: r.finish)
    # a request waits for decode from its first token until it joins a decode batch
    wait_end = np.maximum(decode_start, first)
    has_decode = np.isfinite(decode_start)
    running_start = np.where(has_decode, wait_end, inf)

    done = np.isfinite(finish)
    emit_n = sum(len(r.emit_times) for r in reqs)
    emit_t = np.fromiter(chain.from_iterable(r.emit_times for r in reqs), float, count=emit_n)
    emit_c = np.fromiter(chain.from_iterable(r.emit_counts for r in reqs), float, count=emit_n)
    tokens, _ = np.histogram(emit_t, bins=edges, weights=emit_c)
    finished, _ = np.histogram(finish[done], bins=edges)
    return TimeSeries(
        time=centres.tolist(),
        prefill_queue=_occupancy(arrival, prefill_start, centres).tolist(),
        decode_queue=_occupancy(first[has_decode], wait_end[has_decode], centres).tolist(),
        running=_occupancy(running_start, finish, centres).tolist(),
        output_throughput=(tokens / width).tolist(),
        request_throughput=(finished / width).tolist(),
    )
