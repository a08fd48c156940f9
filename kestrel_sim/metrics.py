"""Metrics of one run, computed from a Recorder only (a simulated run's, or a measured Trace
replayed through one): the same code for both sides.

Names and definitions follow vLLM's `vllm bench serve` result (vllm/benchmarks/serve.py):
- TTFT: first emission minus arrival. E2EL (`latencies`): finish minus arrival.
- TPOT: (e2el - ttft) / (output_tokens - 1), per request with more than one output token.
- ITL: gaps between successive emissions of one request (an emission may carry several
  tokens under speculative decoding), pooled over all requests.
- duration: first arrival to last finish; throughputs divide by it.
- request_goodput: completed requests per second meeting every SLO given (TTFT, TPOT, E2EL),
  as vLLM's --goodput; a request with one output token has TPOT 0.
- max_output_tokens_per_s: the most output tokens in one whole second of the run (vLLM
  counts its buckets from the first request's send time, Kestrel from the run's t = 0);
  max_concurrent_requests: the most requests between arrival and finish at one instant.
- spec_decode_*: a draft is one request in one verify; accepted tokens are the draft tokens
  kept (a request near its end keeps fewer than the target accepted);
  acceptance_rate = accepted / draft tokens in percent, acceptance_length = 1 + accepted /
  drafts, per_position_acceptance_rates[i] = drafts keeping more than i / drafts.
- per-request arrays, one entry per request in order (seconds, as vLLM's; a failed request
  has 0): input_lens, output_lens, ttfts, itls, latencies, start_times (arrival). `itls`
  holds each request's gaps while the run has at most ITL_EXACT_LIMIT of them and is empty
  past that; `itl_source` says whether the ITL statistics came from every gap of the
  completed requests ("exact") or from a histogram with 0.1% wide bins and running sums of
  every request's gaps ("histogram": a run's every request completes in the simulator).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from kestrel_sim.recorder import Recorder, replay
from kestrel_sim.trace import Trace

STAGES = ("prefill", "draft", "verify", "correction", "decode", "kv_transfer")
PER_REQUEST_ARRAYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times")


class Metrics(BaseModel):
    """Results of a run (times in ms, rates per second; per-request arrays in s)."""

    model_config = ConfigDict(extra="forbid")

    duration: float  # s
    completed: int
    failed: int  # requests that never finished
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    request_goodput: float | None  # requests/s meeting the SLO; None without an SLO
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p99_itl_ms: float
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    p99_e2el_ms: float
    spec_decode_acceptance_rate: float | None  # percent of draft tokens accepted
    spec_decode_acceptance_length: float | None  # tokens per round, bonus token included
    spec_decode_num_drafts: int | None
    spec_decode_draft_tokens: int | None
    spec_decode_accepted_tokens: int | None
    spec_decode_per_position_acceptance_rates: list[float]
    itl_source: str  # "exact" | "histogram"
    # where the accepted lengths came from: "simulated" (drawn by the simulator's acceptance
    # model), "controlled" (a runtime run with the real draft, verify and correction work but
    # lengths drawn from the scenario's rates), "organic" (what the target accepted); None
    # without speculative decoding
    acceptance_source: str | None = None
    worker_utilization: dict[str, float]  # worker -> busy fraction of duration
    stage_share: dict[str, float]  # span kind -> share of all worker-busy seconds
    stage_seconds: dict[str, dict[str, float]]  # worker -> span kind -> busy seconds
    preemptions: int
    input_lens: list[int]
    output_lens: list[int]
    ttfts: list[float]
    itls: list[list[float]]
    latencies: list[float]
    start_times: list[float]


def _slo_value(slo, name: str) -> float | None:
    if slo is None:
        return None
    value = slo.get(name) if isinstance(slo, dict) else getattr(slo, name, None)
    return None if value is None else float(value)


def _stats(values: np.ndarray) -> tuple[float, float, float, float]:
    """(mean, median, std, p99) of `values`, zeros for an empty array (as vLLM reports)."""
    if values.size == 0:
        return 0.0, 0.0, 0.0, 0.0
    median, p99 = np.percentile(values, [50, 99])  # one partition for both
    return float(values.mean()), float(median), float(values.std()), float(p99)


def _itl(rec: Recorder, done: np.ndarray) -> tuple[tuple, list[list[float]], str]:
    """ITL (mean, median, std, p99) in ms over completed requests, per-request gap lists in
    s (empty for a failed request, as vLLM's), and where the statistics came from."""
    n = rec.count
    exact = rec.itl.exact()
    if exact is None:  # past the bound: histogram quantiles, running sums (all requests)
        gaps = rec.itl
        mean = gaps.sum / gaps.count
        std = max(gaps.sumsq / gaps.count - mean * mean, 0.0) ** 0.5
        stats = (mean * 1e3, gaps.hist_quantile(0.5) * 1e3, std * 1e3,
                 gaps.hist_quantile(0.99) * 1e3)
        return stats, [], "histogram"
    index, gaps = exact
    bounds = np.searchsorted(index, np.arange(n + 1))
    values = gaps.tolist()
    ok = done.tolist()
    per_request = [values[bounds[i]:bounds[i + 1]] if ok[i] else [] for i in range(n)]
    return _stats(gaps[done[index]] * 1e3), per_request, "exact"


def _max_concurrent(arrival: np.ndarray, finish: np.ndarray) -> int:
    """The most intervals [arrival, finish) open at one instant (a finish before an arrival
    at the same time)."""
    if arrival.size == 0:
        return 0
    t = np.concatenate((arrival, finish))
    step = np.concatenate((np.ones(arrival.size, np.int64), -np.ones(finish.size, np.int64)))
    order = np.lexsort((step, t))
    return int(np.cumsum(step[order]).max())


def _spec_decode(rec: Recorder) -> dict:
    keys = ("spec_decode_acceptance_rate", "spec_decode_acceptance_length",
            "spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens")
    if rec.drafts == 0:
        return dict.fromkeys(keys) | {"spec_decode_per_position_acceptance_rates": []}
    hist = np.zeros(max(rec.k + 1, rec.accepted_hist.size), dtype=np.int64)
    hist[: rec.accepted_hist.size] = rec.accepted_hist
    accepted = int(np.dot(np.arange(hist.size), hist))
    beyond = hist[::-1].cumsum()[::-1]  # [n]: rounds keeping n or more
    rate = 100.0 * accepted / rec.draft_tokens if rec.draft_tokens else 0.0
    return dict(zip(keys, (rate, 1.0 + accepted / rec.drafts, rec.drafts, rec.draft_tokens,
                           accepted))) | {
        "spec_decode_per_position_acceptance_rates":
            [float(beyond[i + 1] / rec.drafts) for i in range(rec.k)]}


def _stage_seconds(rec: Recorder) -> dict[str, dict[str, float]]:
    """worker -> stage -> busy seconds, workers by name, stages in STAGES order."""
    rank = {kind: i for i, kind in enumerate(STAGES)}

    def by_stage(seconds: dict[str, float]) -> dict[str, float]:
        return dict(sorted(seconds.items(), key=lambda kv: rank.get(kv[0], len(rank))))

    return {w: by_stage(rec.workers[w].seconds) for w in sorted(rec.workers)}


def metrics_from(rec: Recorder, slo=None) -> Metrics:
    """Metrics of a recorded run; `slo` has optional ttft_ms / tpot_ms / e2el_ms (object or
    dict)."""
    done = rec.completed()
    arrival = rec.view("arrival")
    first, finish = rec.view("first_emit")[done], rec.view("finish_time")[done]
    out = rec.view("output")[done].astype(float)
    start = float(np.nanmin(arrival)) if done.any() else 0.0
    end = float(finish.max()) if done.any() else 0.0
    duration = end - start
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)

    ttft = (first - arrival[done]) * 1e3
    e2el = (finish - arrival[done]) * 1e3
    multi = out > 1
    tpot_all = np.zeros(out.size)  # single-token requests have TPOT 0 (vLLM, for goodput)
    tpot_all[multi] = (e2el[multi] - ttft[multi]) / (out[multi] - 1)
    n_in = int(rec.view("prompt")[done].sum())
    n_out = int(out.sum())

    goodput = None
    limits = [(_slo_value(slo, f"{name}_ms"), values)
              for name, values in (("ttft", ttft), ("tpot", tpot_all), ("e2el", e2el))]
    if any(limit is not None for limit, _ in limits):
        ok = np.ones(out.size, dtype=bool)
        for limit, values in limits:
            if limit is not None:
                ok &= values <= limit
        goodput = per_s(int(ok.sum()))

    itl, itls, itl_source = _itl(rec, done)
    seconds = _stage_seconds(rec)
    by_kind = {kind: sum(s.get(kind, 0.0) for s in seconds.values()) for kind in STAGES}
    by_kind = {k: v for k, v in by_kind.items() if any(k in s for s in seconds.values())}
    total = sum(by_kind.values())
    stats = {name: _stats(values) for name, values in
             (("ttft", ttft), ("tpot", tpot_all[multi]), ("e2el", e2el))} | {"itl": itl}

    zeros = np.zeros(rec.count)
    ttfts, latencies = zeros.copy(), zeros.copy()
    ttfts[done], latencies[done] = ttft / 1e3, e2el / 1e3
    return Metrics.model_construct(  # built here, plain Python values: no validation pass
        duration=duration,
        completed=int(done.sum()),
        failed=int(rec.count - done.sum()),
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=per_s(int(done.sum())),
        request_goodput=goodput,
        output_throughput=per_s(n_out),
        total_token_throughput=per_s(n_in + n_out),
        max_output_tokens_per_s=float(rec.tokens.per_second.max(initial=0.0)),
        max_concurrent_requests=_max_concurrent(arrival[done], finish),
        **{f"{stat}_{name}_ms": values[i] for name, values in stats.items()
           for i, stat in enumerate(("mean", "median", "std", "p99"))},
        **_spec_decode(rec),
        itl_source=itl_source,
        worker_utilization={w: per_s(rec.workers[w].busy) for w in sorted(rec.workers)},
        stage_share={k: (v / total if total > 0 else 0.0) for k, v in by_kind.items()},
        stage_seconds=seconds,
        preemptions=int(rec.view("preemptions").sum()),
        input_lens=rec.view("prompt").tolist(),
        output_lens=np.where(done, rec.view("output"), 0).tolist(),
        ttfts=ttfts.tolist(),
        itls=itls,
        latencies=latencies.tolist(),
        start_times=arrival.tolist(),
    )


def recorder_of(trace: Trace) -> Recorder:
    """The Recorder that saw the run: a simulated run's own, or a Trace replayed."""
    rec = getattr(trace, "recorder", None)
    return rec if rec is not None else replay(trace)


def compute_metrics(trace: Trace, slo=None) -> Metrics:
    """Metrics of a run: a simulated run (its Recorder) or a whole Trace (replayed)."""
    return with_source(metrics_from(recorder_of(trace), slo), trace.meta)


def with_source(m: Metrics, meta: dict) -> Metrics:
    """m with acceptance_source from the run's meta (source sim or hardware, and a hardware
    run's acceptance_controlled)."""
    if m.spec_decode_num_drafts is None:
        return m
    if meta.get("source") == "hardware":
        source = "controlled" if meta.get("acceptance_controlled") else "organic"
    else:
        source = "simulated"
    return m.model_copy(update={"acceptance_source": source})


def stage_seconds(trace: Trace) -> dict[tuple[str, str], float]:
    """Seconds per (worker, span kind), queue waits excluded, a mixed step's seconds split
    among its spans by tokens (tallies.WorkerTally)."""
    rec = recorder_of(trace)
    return {(w, kind): s for w, tally in sorted(rec.workers.items())
            for kind, s in tally.seconds.items()}


def worker_busy(trace: Trace) -> dict[str, float]:
    """Seconds each worker spent on spans (overlaps counted once), queue waits excluded."""
    rec = recorder_of(trace)
    return {w: rec.workers[w].busy for w in sorted(rec.workers)}
