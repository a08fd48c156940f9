"""One Recorder for simulated and measured runs: a run recorded online gives the metrics and
time series its whole Trace gives replayed, whatever the Trace keeps; Little's law holds in
the time series file; a sampled trace stays within its budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.metrics import compute_metrics
from kestrel_sim.scenario import Scenario
from kestrel_sim.sim import keep
from kestrel_sim.timeseries import TimeSeries, compute_timeseries
from kestrel_sim.trace import Trace


def scenario(**over) -> Scenario:
    data = {
        "name": "recorder",
        "draft": {"model": "qwen3-0.6b"},
        "spec": {"k": 4, "correction": "separate", "acceptance": {"alpha": 0.6}},
        "workload": {
            "arrivals": {"process": "poisson", "rate": 40.0},
            "requests": 400,
            "prompt_tokens": {"dist": "uniform", "low": 32, "high": 1500},
            "output_tokens": {"dist": "uniform", "low": 1, "high": 200},
            "seed": 5,
        },
        "slo": {"ttft_ms": 200, "tpot_ms": 20},
    }
    for key, value in over.items():
        node = data
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return Scenario.load_from_dict(data)


CASES = {
    "colocated-mixed": {},
    "alternate-fused": {"serving.prefill_schedule": "alternate", "spec.correction": "fused"},
    "disaggregated": {"serving.mode": "disaggregated", "serving.decode_workers": 2},
    "preempting": {"serving.kv_capacity_tokens": 6000, "workload.arrivals.rate": 200.0},
}


@pytest.mark.parametrize("case", CASES)
def test_online_metrics_equal_the_whole_trace_replayed(case, tmp_path):
    sc = scenario(**CASES[case])
    run = simulate(sc, trace="full")
    if case == "preempting":
        assert run.meta["preemptions"] > 0
    run.save(tmp_path / "trace.json")  # the file the runtime writes, read back
    loaded = Trace.load(tmp_path / "trace.json")
    assert compute_metrics(loaded, sc.slo) == run.metrics  # exactly: one code, same input
    assert compute_timeseries(loaded) == run.timeseries
    assert compute_metrics(run, sc.slo) == run.metrics


def test_trace_modes_change_the_trace_not_the_numbers():
    sc = scenario()
    runs = {mode: simulate(sc, trace=mode) for mode in ("full", "sample", "none")}
    full = runs["full"]
    for mode, run in runs.items():
        assert run.metrics == full.metrics, mode
        assert run.timeseries == full.timeseries, mode
        assert run.meta["trace"]["mode"] == mode
        assert run.meta["trace"]["spans_seen"] == len(full.spans)
    # under the sample budget a sample keeps everything
    assert runs["sample"].meta["trace"]["complete"]
    assert len(runs["sample"].spans) == len(full.spans)
    assert runs["sample"].requests == full.requests
    assert runs["none"].spans == [] and runs["none"].requests == []
    assert not runs["none"].meta["trace"]["complete"]


def test_a_sample_keeps_evenly_spaced_windows_within_its_budget(monkeypatch):
    monkeypatch.setattr(keep, "SAMPLE_SPANS", 500)
    monkeypatch.setattr(keep, "WINDOW_S", 0.25)
    sc = scenario()
    full, run = simulate(sc, trace="full"), simulate(sc, trace="sample")
    kept = run.meta["trace"]
    assert not kept["complete"] and kept["spans_kept"] == len(run.spans) <= 500
    assert kept["spans_seen"] == len(full.spans) > 4 * 500
    every = kept["windows_every_s"]
    assert every > 0.25 and every / 0.25 == 2 ** round(np.log2(every / 0.25))
    expected = [s for s in full.spans if (s.start // 0.25) % (every / 0.25) == 0]
    assert run.spans == expected  # every span starting in a kept window, nothing else
    by_id = {r.id: r for r in full.requests}
    assert run.requests and all(r == by_id[r.id] for r in run.requests)  # whole records
    assert {r.id for r in run.requests} == {
        r.id for r in full.requests if (r.arrival // 0.25) % (every / 0.25) == 0}
    assert run.metrics == full.metrics
    with pytest.raises(Exception, match="keeps only part of its run"):
        compute_metrics(Trace(spans=run.spans, requests=run.requests, meta=run.meta))


def test_littles_law_from_the_timeseries_file(tmp_path):
    sc = scenario(**{"workload.arrivals.rate": 60.0, "workload.requests": 800})
    run = simulate(sc)
    (tmp_path / "timeseries.json").write_text(run.timeseries.model_dump_json())
    (tmp_path / "metrics.json").write_text(run.metrics.model_dump_json())
    ts = TimeSeries.model_validate_json((tmp_path / "timeseries.json").read_text())
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    w = ts.bin_seconds
    in_system = np.array(ts.in_system)
    states = np.sum([ts.prefill_queue, ts.prefilling, ts.decode_queue, ts.running], axis=0)
    assert states == pytest.approx(in_system, abs=1e-9)  # every request in one state
    assert in_system.max() > 10  # loaded: requests queue and batch
    # L = lambda W: the mean number in the system over the run is the arrival rate times
    # the mean latency, i.e. request-seconds in the system = the sum of the latencies
    assert in_system.sum() * w == pytest.approx(sum(metrics["latencies"]), rel=1e-9)
    assert np.sum(ts.output_throughput) * w == pytest.approx(metrics["total_output_tokens"])
    assert np.sum(ts.request_throughput) * w == pytest.approx(metrics["completed"])
    assert len(ts.time) <= 256 and ts.time[-1] + w / 2 >= metrics["duration"]


def test_a_bad_trace_mode_is_refused():
    from kestrel_sim.errors import KestrelError

    with pytest.raises(KestrelError, match="expected full, sample or none"):
        simulate(scenario(), trace="some")
