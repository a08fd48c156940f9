"""Report figures and the self-contained HTML pages."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_sim.metrics import compute_metrics
from kestrel_sim.timeseries import compute_timeseries
from kestrel_sim.trace import RequestRecord, Span, Trace
from reports import figures
from reports.html import run_report, sweep_report


def _spec_trace(n: int = 20, k: int = 3) -> Trace:
    """n requests served one after another: prefill, then rounds of draft+verify."""
    rng = np.random.default_rng(1)
    spans, reqs, t = [], [], 0.0
    for i in range(n):
        arrival = 0.01 * i
        t = max(t, arrival)
        rec = RequestRecord(id=i, arrival=arrival, prompt_tokens=64, prefill_start=t)
        spans.append(Span("prefill", "gpu0/target", t, t + 0.004, [i], tokens=64))
        t += 0.004
        rec.emit_times.append(t)
        rec.emit_counts.append(1)
        rec.decode_start = t
        for _ in range(3):
            spans.append(Span("draft", "gpu0/draft", t, t + 0.001, [i], tokens=k))
            t += 0.001
            acc = int(rng.integers(0, k + 1))
            spans.append(Span("verify", "gpu0/target", t, t + 0.002, [i], tokens=k + 1,
                              proposed=k, accepted=[acc]))
            t += 0.002
            rec.emit_times.append(t)
            rec.emit_counts.append(acc + 1)
        rec.output_tokens = sum(rec.emit_counts)
        rec.finish = t
        reqs.append(rec)
    return Trace(spans=spans, requests=reqs, meta={"name": "hand-spec"})


def test_timeline_has_one_bar_per_span_by_stage():
    trace = _spec_trace()
    fig = figures.timeline_figure(trace)
    counts = {t.name: len(t.x) for t in fig.data}
    assert counts == {"prefill": 20, "draft": 60, "verify": 60}
    verify = next(t for t in fig.data if t.name == "verify")
    assert verify.x[0] == pytest.approx(0.002)


def test_timeline_window_limits_spans():
    trace = _spec_trace(n=50)
    lo, hi = figures.timeline_window(trace, max_spans=40)
    fig = figures.timeline_figure(trace, window=(lo, hi))
    assert sum(len(t.x) for t in fig.data) == 40
    assert lo > 0  # a window from the middle of the run


def test_acceptance_histogram_is_the_share_of_rounds_per_length():
    trace = _spec_trace()
    fig = figures.acceptance_figure(compute_metrics(trace))
    assert list(fig.data[0].x) == [1, 2, 3, 4]
    accepted = [a for s in trace.spans if s.kind == "verify" for a in s.accepted]
    shares = np.bincount(accepted, minlength=4) / len(accepted)
    assert list(fig.data[0].y) == pytest.approx(shares.tolist())
    trace.spans = [s for s in trace.spans if s.kind != "verify"]
    assert figures.acceptance_figure(compute_metrics(trace)) is None


def test_stage_time_stacks_busy_seconds():
    fig = figures.stage_time_figure(compute_metrics(_spec_trace()))
    by_kind = {t.name: dict(zip(t.y, t.x)) for t in fig.data}
    assert by_kind["verify"]["gpu0/target"] == pytest.approx(20 * 3 * 0.002)
    assert by_kind["draft"]["gpu0/draft"] == pytest.approx(20 * 3 * 0.001)
    assert by_kind["prefill"].get("gpu0/draft", 0.0) == 0.0


def test_mixed_forward_draws_its_chunk_on_top_and_is_stacked_once():
    """A prefill chunk riding in a verify (same worker, start, end): a thin bar over the
    verify in the timeline; its seconds split by tokens in the stage-time bars."""
    trace = _spec_trace(n=2)
    v = next(s for s in trace.spans if s.kind == "verify")
    trace.spans.append(Span("prefill", v.worker, v.start, v.end, [9], tokens=3 * v.tokens))
    fig = figures.timeline_figure(trace)
    riding = next(t for t in fig.data if t.name == "prefill in decode/verify")
    assert list(riding.base) == [v.start] and riding.width == 0.3
    assert len(next(t for t in fig.data if t.name == "prefill").x) == 2  # the two alone
    stacked = figures.stage_time_figure(compute_metrics(trace))
    target = sum(dict(zip(t.y, t.x)).get(v.worker, 0.0) for t in stacked.data)
    assert target == pytest.approx(2 * 0.004 + 6 * 0.002)  # busy time, counted once
    by_kind = {t.name: dict(zip(t.y, t.x)) for t in stacked.data}
    assert by_kind["prefill"][v.worker] == pytest.approx(2 * 0.004 + 0.75 * 0.002)


def test_cdf_ends_at_the_maximum():
    trace = _spec_trace()
    fig = figures.latency_cdf_figure(compute_metrics(trace))
    e2e = fig.data[2]
    assert e2e.y[-1] == pytest.approx(1.0)
    assert e2e.x[-1] == pytest.approx(max(r.finish - r.arrival for r in trace.requests) * 1e3)


def test_run_report_is_self_contained(tmp_path):
    trace = _spec_trace()
    metrics = compute_metrics(trace, {"ttft_ms": 100})
    text = run_report(trace, metrics, compute_timeseries(trace), {"name": "hand-spec"})
    assert text.startswith("<!DOCTYPE html>")
    assert "<script src=\"http" not in text  # plotly.js embedded, not fetched
    assert "Plotly.newPlot" in text and len(text) > 1_000_000
    # timeline, stage time, CDFs, time series, acceptance
    assert text.count("class=\"plotly-graph-div\"") == 5
    assert "spec_decode_acceptance_length" in text and "worker_utilization[gpu0/draft]" in text
    assert "stage_seconds[gpu0/target][verify]" in text
    assert "ttfts[" not in text  # the per-request arrays stay in metrics.json
    assert "Uncalibrated" not in text and "<b>Trace.</b>" not in text


def test_report_says_a_roofline_result_is_uncalibrated():
    trace = _spec_trace()
    trace.meta["costs"] = "roofline"
    text = run_report(trace, compute_metrics(trace), compute_timeseries(trace))
    assert "(uncalibrated roofline)</title>" in text and "<b>Uncalibrated.</b>" in text


def test_report_and_timeline_of_a_sampled_trace():
    """A sampled trace says what it kept; its timeline stays inside one kept window."""
    trace = _spec_trace(n=400)  # 0.01 s apart, ~4 s of spans
    metrics, timeseries = compute_metrics(trace), compute_timeseries(trace)
    trace.meta["trace"] = {"mode": "sample", "complete": False, "spans_seen": 2800,
                           "spans_kept": 1400, "sample_budget_spans": 1000, "window_s": 0.5,
                           "windows_every_s": 1.0}
    trace.spans = [s for s in trace.spans if (s.start // 0.5) % 2 == 0]
    lo, hi = figures.timeline_window(trace, max_spans=1000)
    slot = lo // 0.5  # a kept window (even), in the middle of the run, and nothing past it
    assert slot % 2 == 0 and 1.0 <= lo <= 3.0 and hi == pytest.approx((slot + 1) * 0.5)
    text = run_report(trace, metrics, timeseries)
    assert "1,400 of 2,800 spans" in text and "windows every 1 s" in text


def _sweep_rows() -> list[dict]:
    rows = []
    for k in (1, 2, 4):
        for rate in (1.0, 2.0):
            rows.append({"params": {"spec.k": k, "workload.arrivals.rate": rate},
                         "metrics": {"output_throughput": 100.0 * k * rate,
                                     "mean_ttft_ms": 10.0 * rate, "request_goodput": None}})
    return rows


def test_sweep_curves_one_line_per_group():
    fig = figures.sweep_curves_figure(_sweep_rows(), ["spec.k", "workload.arrivals.rate"])
    throughput = [t for t in fig.data if t.xaxis == "x"]
    assert len(throughput) == 2  # one line per rate
    assert list(throughput[1].y) == [200.0, 400.0, 800.0]


def test_sweep_heatmap_places_values():
    fig = figures.sweep_heatmap_figure(_sweep_rows(), "spec.k", "workload.arrivals.rate",
                                       "output_throughput")
    z = np.array(fig.data[0].z)
    assert z.shape == (3, 2)
    assert z[2, 1] == pytest.approx(800.0)


def test_sweep_report_has_heatmaps_for_two_axes():
    text = sweep_report("s", _sweep_rows(), ["spec.k", "workload.arrivals.rate"])
    # heatmaps for the metrics the rows carry (request_goodput is None here)
    assert "<h2>output_throughput</h2>" in text and "<h2>request_goodput</h2>" not in text
    one_axis = [r for r in _sweep_rows() if r["params"]["workload.arrivals.rate"] == 1.0]
    for r in one_axis:
        del r["params"]["workload.arrivals.rate"]
    assert "<h2>output_throughput</h2>" not in sweep_report("s", one_axis, ["spec.k"])
