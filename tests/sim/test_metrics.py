"""Metrics from hand-built Traces whose answers are worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_sim.metrics import compute_metrics, request_latencies
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
    assert m.completed == 2
    assert m.duration == pytest.approx(1.5)
    assert m.request_throughput == pytest.approx(2 / 1.5)
    assert m.output_throughput == pytest.approx(8 / 1.5)
    assert m.total_token_throughput == pytest.approx(38 / 1.5)
    assert m.mean_ttft_ms == pytest.approx(200.0)
    assert m.median_ttft_ms == pytest.approx(200.0)
    assert m.mean_tpot_ms == pytest.approx((100.0 + 200.0 / 3) / 2)
    assert m.mean_e2el_ms == pytest.approx(450.0)
    assert m.mean_itl_ms == pytest.approx(500.0 / 3)
    assert m.median_itl_ms == pytest.approx(200.0)
    assert m.p99_itl_ms == pytest.approx(np.percentile([100.0, 200.0, 200.0], 99))
    assert m.request_goodput is None


def test_itl_excludes_gaps_between_requests():
    lat = request_latencies(_two_requests())
    assert sorted(lat.itl_ms.tolist()) == pytest.approx([100.0, 200.0, 200.0])


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


def test_acceptance_metrics_from_verify_spans():
    m = compute_metrics(_two_requests())
    assert m.acceptance_rate == pytest.approx(3 / 4)
    assert m.mean_acceptance_length == pytest.approx(2.5)
    assert m.per_position_acceptance == pytest.approx([1.0, 0.5])


def test_no_speculation_gives_no_acceptance():
    trace = _two_requests()
    trace.spans = [s for s in trace.spans if s.kind != "verify"]
    m = compute_metrics(trace)
    assert m.acceptance_rate is None
    assert m.mean_acceptance_length is None
    assert m.per_position_acceptance == []


def test_worker_utilization_counts_overlaps_once_and_skips_queue_waits():
    trace = _two_requests()
    trace.spans.append(Span("decode", "gpu0/target", 0.05, 0.12, [0]))  # overlaps prefill
    util = compute_metrics(trace).worker_utilization
    # target busy: [0, 0.12) U [0.15, 0.2) U [1.1, 1.3) U [1.35, 1.5) = 0.12+0.05+0.2+0.15
    assert util["gpu0/target"] == pytest.approx(0.52 / 1.5)
    assert util["gpu0/draft"] == pytest.approx(0.05 / 1.5)
    assert "prefill_queue" not in util


def test_stage_share_sums_span_seconds_by_kind():
    share = compute_metrics(_two_requests()).stage_share
    # prefill 0.1 + 0.2, draft 0.05, verify 0.05 + 0.15 of 0.55 busy seconds
    assert share == pytest.approx({"prefill": 0.3 / 0.55, "draft": 0.05 / 0.55,
                                   "verify": 0.2 / 0.55})


def test_unfinished_requests_are_not_completed():
    trace = _two_requests()
    trace.requests.append(RequestRecord(id=2, arrival=1.2, prompt_tokens=5))
    m = compute_metrics(trace)
    assert m.completed == 2
    assert m.duration == pytest.approx(1.5)


def test_empty_trace_gives_zeros():
    m = compute_metrics(Trace())
    assert m.completed == 0
    assert m.request_throughput == 0.0
    assert m.mean_ttft_ms == 0.0


def test_timeseries_queue_lengths_and_throughput():
    trace = _two_requests()
    ts = compute_timeseries(trace, bins=15)  # 0.1 s bins over [0, 1.5]
    t = np.array(ts.time)
    # request 1 waits for prefill during [1.0, 1.1): bin centred at 1.05
    assert ts.prefill_queue[int(np.argmin(abs(t - 1.05)))] == 1
    assert ts.prefill_queue[int(np.argmin(abs(t - 0.55)))] == 0
    # request 1 waits for decode during [1.3, 1.35): bin centred at 1.35 is past it
    assert ts.decode_queue[int(np.argmin(abs(t - 1.25)))] == 0
    assert ts.running[int(np.argmin(abs(t - 0.15)))] == 1
    # all 8 tokens counted once: sum(rate * width) == 8
    assert sum(ts.output_throughput) * 0.1 == pytest.approx(8)
    assert sum(ts.request_throughput) * 0.1 == pytest.approx(2)


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


def test_result_names_are_vllms():
    """benchmark_serving's result keys, so a vLLM result and ours line up column by column."""
    from kestrel_sim.metrics import Metrics

    vllm = {"completed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "request_goodput", "output_throughput",
            "total_token_throughput"}
    vllm |= {f"{stat}_{name}_ms" for stat in ("mean", "median", "p99")
             for name in ("ttft", "tpot", "itl", "e2el")}
    assert vllm <= set(Metrics.model_fields)
