"""Metrics and time series from hand-built Traces whose answers are worked out by hand, and
their names against vLLM's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kestrel_sim import tallies
from kestrel_sim.errors import KestrelError
from kestrel_sim.metrics import PER_REQUEST_ARRAYS, Metrics, compute_metrics
from kestrel_sim.timeseries import compute_timeseries
from kestrel_sim.trace import RequestRecord, Span, Trace


def _two_requests() -> Trace:
    # request 0: arrives 0, first token 0.1, then emissions at 0.2 (2 tokens), 0.4 (1 token)
    #   ttft 100 ms, e2el 400 ms, 4 tokens -> tpot (400-100)/3 = 100 ms; itl 100, 200 ms
    # request 1: arrives 1.0, first token 1.3, one more emission at 1.5 (3 tokens)
    #   ttft 300 ms, e2el 500 ms, 4 tokens -> tpot 200/3 ms; itl 200 ms
    r0 = RequestRecord(id=0, arrival=0.0, prompt_tokens=10, output_tokens=4,
                       prefill_start=0.0, decode_start=0.1, finish=0.4,
                       emit_times=[0.1, 0.2, 0.4], emit_counts=[1, 2, 1])
    r1 = RequestRecord(id=1, arrival=1.0, prompt_tokens=20, output_tokens=4,
                       prefill_start=1.1, decode_start=1.35, finish=1.5,
                       emit_times=[1.3, 1.5], emit_counts=[1, 3])
    spans = [
        Span("prefill", "gpu0/target", 0.0, 0.1, [0], tokens=10),
        Span("draft", "gpu0/draft", 0.1, 0.15, [0], tokens=2),
        Span("verify", "gpu0/target", 0.15, 0.2, [0], tokens=3, proposed=2, accepted=[1]),
        Span("prefill", "gpu0/target", 1.1, 1.3, [1], tokens=20),
        Span("verify", "gpu0/target", 1.35, 1.5, [1], tokens=3, proposed=2, accepted=[2]),
        Span("queue_wait", "prefill_queue", 1.0, 1.1, [1]),
    ]
    return Trace(spans=spans, requests=[r0, r1], meta={"name": "hand"})


def test_latency_metrics_match_hand_computation():
    m = compute_metrics(_two_requests())
    assert (m.completed, m.failed) == (2, 0)
    assert m.duration == pytest.approx(1.5)
    assert m.request_throughput == pytest.approx(2 / 1.5)
    assert m.output_throughput == pytest.approx(8 / 1.5)
    assert m.total_token_throughput == pytest.approx(38 / 1.5)
    assert m.mean_ttft_ms == pytest.approx(200.0)
    assert m.median_ttft_ms == pytest.approx(200.0)
    assert m.std_ttft_ms == pytest.approx(100.0)
    assert m.mean_tpot_ms == pytest.approx((100.0 + 200.0 / 3) / 2)
    assert m.mean_e2el_ms == pytest.approx(450.0)
    assert m.std_e2el_ms == pytest.approx(50.0)
    assert m.mean_itl_ms == pytest.approx(500.0 / 3)
    assert m.median_itl_ms == pytest.approx(200.0)
    assert m.std_itl_ms == pytest.approx(np.std([100.0, 200.0, 200.0]))
    assert m.p99_itl_ms == pytest.approx(np.percentile([100.0, 200.0, 200.0], 99))
    assert m.request_goodput is None
    assert m.itl_source == "exact"


def test_per_request_arrays_are_vllms_in_seconds():
    m = compute_metrics(_two_requests())
    assert m.input_lens == [10, 20] and m.output_lens == [4, 4]
    assert m.ttfts == pytest.approx([0.1, 0.3])
    assert m.latencies == pytest.approx([0.4, 0.5])
    assert m.start_times == pytest.approx([0.0, 1.0])
    # gaps within each request only (not from request 0's last emission to request 1's first)
    assert m.itls[0] == pytest.approx([0.1, 0.2]) and m.itls[1] == pytest.approx([0.2])


def test_peak_tokens_per_second_and_concurrency():
    trace = _two_requests()
    m = compute_metrics(trace)
    assert m.max_output_tokens_per_s == 4  # second [1, 2): 1 + 3 tokens; [0, 1): 1 + 2 + 1
    assert m.max_concurrent_requests == 1  # [0, 0.4) and [1.0, 1.5) never overlap
    trace.requests[1].arrival = 0.3  # now they do; a finish at an arrival's instant does not
    assert compute_metrics(trace).max_concurrent_requests == 2
    trace.requests[1].arrival = 0.4
    assert compute_metrics(trace).max_concurrent_requests == 1


def test_goodput_counts_requests_meeting_every_slo():
    trace = _two_requests()
    assert compute_metrics(trace, {"ttft_ms": 150}).request_goodput == pytest.approx(1 / 1.5)
    assert compute_metrics(trace, {"ttft_ms": 500, "tpot_ms": 90}).request_goodput == pytest.approx(
        1 / 1.5
    )
    assert compute_metrics(trace, {"ttft_ms": 500, "tpot_ms": 150}).request_goodput == pytest.approx(
        2 / 1.5
    )


def test_goodput_honours_an_e2el_slo():
    # e2el: request 0 400 ms, request 1 500 ms (vLLM's --goodput e2el:MS)
    trace = _two_requests()
    assert compute_metrics(trace, {"e2el_ms": 450}).request_goodput == pytest.approx(1 / 1.5)
    assert compute_metrics(trace, {"e2el_ms": 500}).request_goodput == pytest.approx(2 / 1.5)
    assert compute_metrics(trace, {"ttft_ms": 500, "e2el_ms": 300}).request_goodput == 0.0


def test_speculative_metrics_as_vllm_computes_them():
    m = compute_metrics(_two_requests())
    # two drafts of 2 tokens; 1 and 2 accepted
    assert (m.spec_decode_num_drafts, m.spec_decode_draft_tokens) == (2, 4)
    assert m.spec_decode_accepted_tokens == 3
    assert m.spec_decode_acceptance_rate == pytest.approx(75.0)  # a percentage
    assert m.spec_decode_acceptance_length == pytest.approx(1 + 3 / 2)
    assert m.spec_decode_per_position_acceptance_rates == pytest.approx([1.0, 0.5])


def test_no_speculation_gives_no_speculative_metrics():
    trace = _two_requests()
    trace.spans = [s for s in trace.spans if s.kind != "verify"]
    m = compute_metrics(trace)
    assert m.spec_decode_acceptance_rate is None and m.spec_decode_num_drafts is None
    assert m.spec_decode_acceptance_length is None
    assert m.spec_decode_per_position_acceptance_rates == []


def test_worker_utilization_counts_overlaps_once_and_skips_queue_waits():
    trace = _two_requests()
    trace.spans.append(Span("decode", "gpu0/target", 0.05, 0.12, [0]))  # overlaps prefill
    util = compute_metrics(trace).worker_utilization
    # target busy: [0, 0.12) U [0.15, 0.2) U [1.1, 1.3) U [1.35, 1.5) = 0.12+0.05+0.2+0.15
    assert util["gpu0/target"] == pytest.approx(0.52 / 1.5)
    assert util["gpu0/draft"] == pytest.approx(0.05 / 1.5)
    assert "prefill_queue" not in util


def test_stage_share_sums_span_seconds_by_kind():
    m = compute_metrics(_two_requests())
    # prefill 0.1 + 0.2, draft 0.05, verify 0.05 + 0.15 of 0.55 busy seconds
    assert m.stage_share == pytest.approx({"prefill": 0.3 / 0.55, "draft": 0.05 / 0.55,
                                           "verify": 0.2 / 0.55})
    assert m.stage_seconds["gpu0/target"] == pytest.approx({"prefill": 0.3, "verify": 0.2})


def test_unfinished_requests_are_failed_with_zeros_as_vllm():
    trace = _two_requests()
    trace.requests.append(RequestRecord(id=2, arrival=1.2, prompt_tokens=5,
                                        emit_times=[1.4, 1.45], emit_counts=[1, 1]))
    m = compute_metrics(trace)
    assert (m.completed, m.failed) == (2, 1)
    assert m.duration == pytest.approx(1.5)
    assert (m.input_lens[2], m.output_lens[2], m.ttfts[2], m.latencies[2]) == (5, 0, 0.0, 0.0)
    assert m.itls[2] == [] and m.mean_itl_ms == pytest.approx(500.0 / 3)  # its gap left out
    assert m.start_times[2] == pytest.approx(1.2)


def test_empty_trace_gives_zeros():
    m = compute_metrics(Trace())
    assert (m.completed, m.failed) == (0, 0)
    assert m.request_throughput == 0.0
    assert m.mean_ttft_ms == 0.0 and m.std_itl_ms == 0.0
    assert compute_timeseries(Trace()).time == []


def test_timeseries_requests_per_state_and_throughput():
    trace = _two_requests()
    ts = compute_timeseries(trace)
    w = ts.bin_seconds
    assert w == 2.0**-7 and len(ts.time) <= 256  # the smallest power of two: 1.5 s in 256
    assert ts.time[0] == pytest.approx(w / 2)

    def seconds(series):  # request-seconds in a state
        return sum(series) * w

    # request 1 waits 0.1 s for prefill; prefills 0.1 + 0.2 s; waits 0.05 s for decode
    assert seconds(ts.prefill_queue) == pytest.approx(0.1)
    assert seconds(ts.prefilling) == pytest.approx(0.3)
    assert seconds(ts.decode_queue) == pytest.approx(0.05)
    assert seconds(ts.running) == pytest.approx(0.3 + 0.15)
    assert seconds(ts.in_system) == pytest.approx(0.4 + 0.5)  # the latencies (Little)
    t = np.array(ts.time)
    inside = int(np.argmin(abs(t - 1.05)))  # a bin inside request 1's prefill wait
    assert ts.prefill_queue[inside] == pytest.approx(1.0) and ts.running[inside] == 0
    # every token and every finish counted once
    assert seconds(ts.output_throughput) == pytest.approx(8)
    assert seconds(ts.request_throughput) == pytest.approx(2)


def test_timeseries_states_add_up_to_the_requests_in_the_system():
    ts = compute_timeseries(_many_requests(300, 20))
    parts = np.sum([ts.prefill_queue, ts.prefilling, ts.decode_queue, ts.running], axis=0)
    assert parts == pytest.approx(ts.in_system, abs=1e-9)


def _many_requests(n: int, emissions: int) -> Trace:
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(0.05, n))
    reqs = []
    for i, a in enumerate(arrivals):
        times = (a + 0.1 + 0.02 * np.arange(emissions)).tolist()
        reqs.append(RequestRecord(id=i, arrival=float(a), prompt_tokens=100,
                                  output_tokens=emissions, prefill_start=float(a),
                                  decode_start=times[0], finish=times[-1],
                                  emit_times=times, emit_counts=[1] * emissions))
    return Trace(requests=reqs)


def test_many_requests_constant_gaps():
    m = compute_metrics(_many_requests(200, 50))
    assert m.mean_itl_ms == pytest.approx(20.0)
    assert m.p99_tpot_ms == pytest.approx(20.0)
    assert m.mean_ttft_ms == pytest.approx(100.0)


def test_benchmark_metrics_20k_requests(benchmark):
    trace = _many_requests(20_000, 100)
    m = benchmark(compute_metrics, trace, {"ttft_ms": 200, "tpot_ms": 50})
    assert m.completed == 20_000


# The result keys of `vllm bench serve` for a generation benchmark, as its
# vllm/benchmarks/serve.py writes them: the `result = {...}` dict of benchmark(), the
# spec_decode_* keys added when the server speculates, and the per-metric statistics that
# process_one_metric() adds (mean / median / std / p99 at the default --metric-percentiles 99)
# for ttft, tpot, itl and e2el. Left out, with the reason: generated_texts and errors (a
# Trace holds no text), queue_times (the client's own wait under --max-concurrency), rtfx
# (speech input); the run's set-up keys (date, backend, model_id, ...) live in scenario.json.
VLLM_RESULT_KEYS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
    "max_output_tokens_per_s", "max_concurrent_requests",
    "spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
    "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
    "spec_decode_per_position_acceptance_rates",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p99")),
]


def test_result_names_are_vllms():
    """One analysis script reads a vLLM result and a Kestrel metrics.json alike."""
    assert set(VLLM_RESULT_KEYS) <= set(Metrics.model_fields)
    assert set(PER_REQUEST_ARRAYS) <= set(VLLM_RESULT_KEYS)
    dumped = json.loads(compute_metrics(_two_requests()).model_dump_json())
    assert set(VLLM_RESULT_KEYS) <= set(dumped)


def test_itl_past_the_exact_bound_comes_from_a_histogram(monkeypatch):
    trace = _many_requests(300, 40)
    rng = np.random.default_rng(2)
    for r in trace.requests:  # gaps spread over three decades
        gaps = rng.lognormal(np.log(0.02), 1.0, len(r.emit_times) - 1)
        r.emit_times = (r.emit_times[0] + np.concatenate(([0.0], np.cumsum(gaps)))).tolist()
        r.finish = r.emit_times[-1]
    exact = compute_metrics(trace)
    monkeypatch.setattr(tallies, "ITL_EXACT_LIMIT", 1000)
    binned = compute_metrics(trace)
    assert (exact.itl_source, binned.itl_source) == ("exact", "histogram")
    assert binned.itls == [] and len(exact.itls) == 300
    assert binned.mean_itl_ms == pytest.approx(exact.mean_itl_ms, rel=1e-12)
    assert binned.std_itl_ms == pytest.approx(exact.std_itl_ms, rel=1e-9)
    for stat in ("median", "p99"):  # within half a bin (0.05%)
        assert getattr(binned, f"{stat}_itl_ms") == pytest.approx(
            getattr(exact, f"{stat}_itl_ms"), rel=6e-4)
    assert binned.mean_ttft_ms == exact.mean_ttft_ms  # the rest is unchanged


def test_a_trace_kept_in_part_is_refused():
    trace = _two_requests()
    trace.meta["trace"] = {"mode": "sample", "complete": False, "spans_kept": 5,
                           "spans_seen": 900}
    with pytest.raises(KestrelError, match="5 of 900 spans"):
        compute_metrics(trace)
