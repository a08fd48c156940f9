"""bench/disagg_2gpu.py's reading of its runs, on the CPU (the runs themselves need two
GPUs): TTFT split into queue, prefill, link wait, transfer and delivery, parts that sum to
TTFT on a measured and on a simulated trace; the table from a run's comparison.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from disagg_2gpu import PARTS, RUNS, table, ttft_parts
from test_serve_engine import all_at_once, scenario

from kestrel_rt.serve import serve
from kestrel_sim.scenario import load_scenario
from kestrel_sim.sim import simulate


def test_the_parts_of_ttft_sum_to_it_on_a_measured_run(folder):
    sc = scenario(folder, {"mode": "disaggregated", "max_batch": 3, "kv_capacity_tokens": 80},
                  requests=6, output=(2, 8), arrivals=all_at_once(6))
    parts = ttft_parts(serve(sc, "cpu").trace)
    assert parts["kv_transfer"] > 0 and parts["prefill"] > 0
    assert sum(parts[p] for p in PARTS) == pytest.approx(parts["ttft"])
    colocated = scenario(folder, {"max_batch": 3, "kv_capacity_tokens": 80}, requests=4,
                         arrivals=all_at_once(4))
    parts = ttft_parts(serve(colocated, "cpu").trace)
    assert parts["kv_transfer"] == parts["link_wait"] == 0
    assert sum(parts[p] for p in PARTS) == pytest.approx(parts["ttft"])


def test_the_bench_scenarios_simulate_with_their_overrides(tmp_path):
    scenario_file, sets = RUNS["disagg-light"]
    sc = load_scenario(scenario_file, [*sets, "serving.devices=[cuda:0, cuda:1]",
                                       "serving.link={bandwidth_gb_s: 300, latency_us: 5}",
                                       "workload.requests=20"])
    run = simulate(sc, trace="full")
    parts = ttft_parts(run)
    assert parts["kv_transfer"] > 0
    assert sum(parts[p] for p in PARTS) == pytest.approx(parts["ttft"])
    # the table reads a run's folder: comparison.json and both traces
    folder = tmp_path / "disagg-light"
    (folder / "sim").mkdir(parents=True)
    run.save(folder / "sim" / "kestrel_trace.json")
    (folder / "comparison.json").write_text(json.dumps({
        "fingerprint": {"device": "NVIDIA H200"},
        "rows": [{"metric": "request_throughput", "measured": 1.9, "predicted": 2.0,
                  "error_pct": 5.26}]}))
    text, data = table(tmp_path, ["disagg-light", "colocated-light"])
    assert "| disagg-light | request_throughput (req/s) | 1.9 | 2 | 5.26 |" in text
    assert "| colocated-light | (not run) |" in text
    assert data["disagg-light"]["ttft"]["sim"]["kv_transfer"] == parts["kv_transfer"]
    assert data["disagg-light"]["ttft"]["hardware"] == {}
