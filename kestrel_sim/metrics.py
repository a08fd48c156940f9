"""Metrics of one run, computed from a Trace only (simulated or measured alike).

Names and definitions follow vLLM's serving benchmark (`benchmark_serving`):
- TTFT: first emission minus arrival.
- TPOT: (e2el - ttft) / (output_tokens - 1), per request with more than one output token.
- ITL: gaps between successive emissions of one request (an emission may carry several
  tokens under speculative decoding), pooled over all requests.
- E2EL: finish minus arrival.
- duration: last finish minus first arrival; throughputs divide by it.
- request_goodput: completed requests per second meeting every SLO given (TTFT, TPOT, E2EL), as
  vLLM's --goodput; a request with one output token has TPOT 0.
Speculative decoding metrics come from `verify` spans: each (request, round) pair proposes
`proposed` draft tokens and accepts `accepted[i]` of them, then gains one bonus/correction
token, so a round yields accepted + 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
from pydantic import BaseModel, ConfigDict

from kestrel_sim.trace import Trace

BUSY_EXCLUDED = ("queue_wait",)  # span kinds that do not occupy a worker


class Metrics(BaseModel):
    """Scalar results of a run (times in ms, rates per second)."""

    model_config = ConfigDict(extra="forbid")

    completed: int
    duration: float  # s
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    request_goodput: float | None  # requests/s meeting the SLO; None without an SLO
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    mean_e2el_ms: float
    median_e2el_ms: float
    p99_e2el_ms: float
    acceptance_rate: float | None  # accepted / proposed draft tokens
    mean_acceptance_length: float | None  # tokens per round incl. the bonus token
    per_position_acceptance: list[float]  # [i]: fraction of rounds accepting > i drafts
    worker_utilization: dict[str, float]  # worker -> busy fraction of duration
    stage_share: dict[str, float]  # span kind -> share of all worker-busy seconds
    preemptions: int


@dataclass
class RequestLatencies:
    """Per-request latency arrays of completed requests (ms), for CDFs."""

    ttft_ms: np.ndarray
    tpot_ms: np.ndarray  # only requests with more than one output token
    e2el_ms: np.ndarray
    itl_ms: np.ndarray  # pooled gaps between emissions


def _slo_value(slo, name: str) -> float | None:
    if slo is None:
        return None
    value = slo.get(name) if isinstance(slo, dict) else getattr(slo, name, None)
    return None if value is None else float(value)


def _stats(values: np.ndarray) -> tuple[float, float, float]:
    """(mean, median, p99) of `values`, zeros for an empty array (as vLLM reports)."""
    if values.size == 0:
        return 0.0, 0.0, 0.0
    return (
        float(values.mean()),
        float(np.median(values)),
        float(np.percentile(values, 99)),
    )


def _completed(trace: Trace) -> list:
    return [r for r in trace.requests if r.finish is not None and r.emit_times]


def _itl_ms(done: list) -> np.ndarray:
    """Gaps between successive emissions within each request, pooled, in ms."""
    counts = np.fromiter((len(r.emit_times) for r in done), dtype=np.int64, count=len(done))
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0)
    times = np.fromiter(chain.from_iterable(r.emit_times for r in done), float, count=total)
    gaps = np.diff(times)
    # drop the gap from one request's last emission to the next request's first
    boundaries = np.cumsum(counts)[:-1] - 1
    keep = np.ones(gaps.size, dtype=bool)
    keep[boundaries[boundaries < gaps.size]] = False
    return gaps[keep] * 1e3


def request_latencies(trace: Trace) -> RequestLatencies:
    """TTFT, TPOT, E2EL per completed request and the pooled ITL, all in ms."""
    done = _completed(trace)
    n = len(done)
    arrival = np.fromiter((r.arrival for r in done), float, count=n)
    first = np.fromiter((r.emit_times[0] for r in done), float, count=n)
    finish = np.fromiter((r.finish for r in done), float, count=n)
    out = np.fromiter((r.output_tokens for r in done), float, count=n)
    ttft = (first - arrival) * 1e3
    e2el = (finish - arrival) * 1e3
    multi = out > 1
    tpot = (e2el[multi] - ttft[multi]) / (out[multi] - 1)
    return RequestLatencies(ttft_ms=ttft, tpot_ms=tpot, e2el_ms=e2el, itl_ms=_itl_ms(done))


def acceptance_lengths(trace: Trace) -> tuple[np.ndarray, int]:
    """Accepted drafts per (request, verify round), and the largest k proposed."""
    spans = [s for s in trace.spans if s.kind == "verify" and s.accepted]
    if not spans:
        return np.zeros(0, dtype=np.int64), 0
    accepted = np.fromiter(chain.from_iterable(s.accepted for s in spans), dtype=np.int64)
    return accepted, max(s.proposed for s in spans)


def _acceptance(trace: Trace) -> tuple[float | None, float | None, list[float]]:
    accepted, k = acceptance_lengths(trace)
    if accepted.size == 0:
        return None, None, []
    proposed = sum(s.proposed * len(s.accepted) for s in trace.spans
                   if s.kind == "verify" and s.accepted)
    rate = float(accepted.sum() / proposed) if proposed else None
    per_position = [float((accepted > i).mean()) for i in range(k)]
    return rate, float(accepted.mean() + 1.0), per_position


def _union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of the union of intervals [start, end)."""
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    # an interval adds only what lies beyond everything before it
    prev_reach = np.concatenate(([-np.inf], reach[:-1]))
    lo = np.maximum(starts, prev_reach)
    return float(np.clip(ends - lo, 0.0, None).sum())


def worker_busy(trace: Trace) -> dict[str, float]:
    """Seconds each worker spent on spans (overlaps counted once), queue waits excluded."""
    by_worker: dict[str, tuple[list[float], list[float]]] = {}
    for s in trace.spans:
        if s.kind in BUSY_EXCLUDED:
            continue
        starts, ends = by_worker.setdefault(s.worker, ([], []))
        starts.append(s.start)
        ends.append(s.end)
    return {w: _union_length(np.asarray(a), np.asarray(b))
            for w, (a, b) in sorted(by_worker.items())}


def stage_seconds(trace: Trace) -> dict[tuple[str, str], float]:
    """Seconds per (worker, span kind), queue waits excluded. Spans of one worker with the
    same start and end are one forward (a mixed step: a decode or verify step carrying a
    prefill chunk); its seconds are split among them in proportion to their tokens, so
    the kinds of a worker add up to its busy time, not more."""
    forwards: dict[tuple[str, float, float], list] = {}
    for s in trace.spans:
        if s.kind not in BUSY_EXCLUDED:
            forwards.setdefault((s.worker, s.start, s.end), []).append(s)
    seconds: dict[tuple[str, str], float] = {}
    for (worker, start, end), group in forwards.items():
        dur = end - start
        tokens = sum(s.tokens for s in group) if len(group) > 1 else 0
        for s in group:
            share = s.tokens / tokens if tokens else 1.0 / len(group)
            key = (worker, s.kind)
            seconds[key] = seconds.get(key, 0.0) + dur * share
    return seconds


def stage_share(trace: Trace) -> dict[str, float]:
    """Share of worker-busy seconds per stage kind (queue waits excluded; a mixed step's
    seconds split as in `stage_seconds`)."""
    seconds: dict[str, float] = {}
    for (_, kind), value in stage_seconds(trace).items():
        seconds[kind] = seconds.get(kind, 0.0) + value
    total = sum(seconds.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in seconds.items()}


def run_window(trace: Trace) -> tuple[float, float]:
    """(start, end) of the measured run: first arrival to last finish."""
    done = _completed(trace)
    if not done:
        return 0.0, 0.0
    start = min(r.arrival for r in trace.requests)
    return start, max(r.finish for r in done)


def compute_metrics(trace: Trace, slo=None) -> Metrics:
    """Metrics of `trace`; `slo` has optional `ttft_ms` / `tpot_ms` / `e2el_ms` (object or dict)."""
    done = _completed(trace)
    lat = request_latencies(trace)
    start, end = run_window(trace)
    duration = end - start
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)

    goodput = None
    ttft_slo, tpot_slo = _slo_value(slo, "ttft_ms"), _slo_value(slo, "tpot_ms")
    e2el_slo = _slo_value(slo, "e2el_ms")
    if ttft_slo is not None or tpot_slo is not None or e2el_slo is not None:
        ok = np.ones(len(done), dtype=bool)
        if ttft_slo is not None:
            ok &= lat.ttft_ms <= ttft_slo
        if tpot_slo is not None:
            out = np.fromiter((r.output_tokens for r in done), float, count=len(done))
            tpot_all = np.zeros(len(done))  # single-token requests have TPOT 0 (vLLM)
            tpot_all[out > 1] = lat.tpot_ms
            ok &= tpot_all <= tpot_slo
        if e2el_slo is not None:
            ok &= lat.e2el_ms <= e2el_slo
        goodput = per_s(int(ok.sum()))

    rate, length, per_position = _acceptance(trace)
    busy = worker_busy(trace)
    ttft, tpot, itl, e2el = (_stats(a) for a in (lat.ttft_ms, lat.tpot_ms, lat.itl_ms, lat.e2el_ms))
    return Metrics(
        completed=len(done),
        duration=duration,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(n_out),
        total_token_throughput=per_s(n_in + n_out),
        request_goodput=goodput,
        mean_ttft_ms=ttft[0], median_ttft_ms=ttft[1], p99_ttft_ms=ttft[2],
        mean_tpot_ms=tpot[0], median_tpot_ms=tpot[1], p99_tpot_ms=tpot[2],
        mean_itl_ms=itl[0], median_itl_ms=itl[1], p99_itl_ms=itl[2],
        mean_e2el_ms=e2el[0], median_e2el_ms=e2el[1], p99_e2el_ms=e2el[2],
        acceptance_rate=rate,
        mean_acceptance_length=length,
        per_position_acceptance=per_position,
        worker_utilization={w: (b / duration if duration > 0 else 0.0) for w, b in busy.items()},
        stage_share=stage_share(trace),
        preemptions=sum(r.preemptions for r in trace.requests),
    )
