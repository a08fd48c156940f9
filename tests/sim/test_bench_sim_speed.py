"""Speed and memory of the simulator: a saturated single-GPU speculative scenario, and a
million-request run of default.yaml.

    python -m pytest tests/sim/test_bench_sim_speed.py --benchmark-enable

reports in each benchmark's extra_info: sim_seconds_per_wall_second (the saturated run timed
here, best of 3: simulate() feeds the Recorder as it goes), metrics_seconds (the metrics and
time series then computed from the Recorder, on first use) and
sim_seconds_per_wall_second_with_metrics (the two together), peak_rss_mb (the peak resident set, VmHWM, of a child process running the same
simulate(), imports included) and rss_after_import_mb (that child before it simulates). Without
--benchmark-enable the saturated run is a test (run once) and the million-request run, a
few minutes long, is skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestrel_sim import simulate
from kestrel_sim.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]
SATURATED = {
    "name": "bench-qwen3-8b-0.6b-k4",
    "hardware": "h200",
    "model": "qwen3-8b",
    "draft": {"model": "qwen3-0.6b", "device": "gpu"},
    "spec": {"k": 4, "correction": "separate", "acceptance": {"alpha": 0.6}},
    "serving": {"mode": "colocated", "max_batch": 64, "max_batched_tokens": 8192,
                "prefill_chunk": 2048},
    # ~2x what the GPU serves: the queue never empties, the batch stays full
    "workload": {"arrivals": {"process": "poisson", "rate": 60.0}, "requests": 4000,
                 "prompt_tokens": {"dist": "uniform", "low": 128, "high": 1024},
                 "output_tokens": {"dist": "uniform", "low": 64, "high": 512}, "seed": 0},
}
MILLION = ["workload.requests=1000000", "workload.arrivals.rate=40"]  # on default.yaml

# run in a child process, so that its peak resident set is this simulation's alone
CHILD = """
import json, resource, sys, time
from kestrel_sim import simulate
from kestrel_sim.scenario import Scenario, load_scenario

def rss_mb():
    # the peak resident set of this process image: VmHWM (ru_maxrss would carry over the
    # parent's peak, since a fork copies its memory and the mark survives the exec)
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

spec = json.loads(sys.argv[1])
sc = (load_scenario(spec["file"], spec["set"]) if "file" in spec
      else Scenario.load_from_dict(spec["scenario"]))
before = rss_mb()
t0, c0 = time.perf_counter(), time.process_time()
run = simulate(sc, trace=spec["trace"])
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
t1 = time.perf_counter()
completed = run.metrics.completed  # the metrics and time series count in the peak too
run.timeseries
metrics_s = time.perf_counter() - t1
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "metrics_s": metrics_s,
                  "sim_seconds": run.meta["end_time"], "completed": completed, "peak_rss_mb": rss_mb(),
                  "rss_after_import_mb": before, "spans_seen": run.meta["trace"]["spans_seen"],
                  "spans_kept": run.meta["trace"]["spans_kept"]}))
"""


def run_child(spec: dict) -> dict:
    """Simulate `spec` ({"scenario": dict} or {"file", "set"}, and "trace") in a child."""
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_bench_saturated_speculative_scenario(benchmark):
    sc = Scenario.load_from_dict(SATURATED)
    run = benchmark.pedantic(simulate, args=(sc,), rounds=3, iterations=1, warmup_rounds=0)
    started = time.perf_counter()
    run.metrics, run.timeseries  # noqa: B018  (computed from the Recorder on first use)
    metrics_seconds = time.perf_counter() - started
    sim_seconds = run.meta["end_time"]
    assert run.metrics.completed == 4000 and all(r.finish is not None for r in run.requests)
    verify = [s for s in run.spans if s.kind == "verify"]
    assert sum(len(s.requests) for s in verify) / len(verify) > 48  # saturated batches
    stats = benchmark.stats.stats if benchmark.stats else None
    best = stats.min if stats else run.meta["wall_seconds"]
    median = stats.median if stats else run.meta["wall_seconds"]
    child = run_child({"scenario": SATURATED, "trace": "sample"})
    assert child["completed"] == 4000 and child["sim_seconds"] == sim_seconds
    benchmark.extra_info["simulated_seconds"] = sim_seconds
    benchmark.extra_info["requests"] = len(run.requests)
    benchmark.extra_info["spans"] = run.meta["trace"]["spans_seen"]
    benchmark.extra_info["sim_seconds_per_wall_second"] = sim_seconds / best
    benchmark.extra_info["sim_seconds_per_wall_second_median"] = sim_seconds / median
    benchmark.extra_info["metrics_seconds"] = metrics_seconds
    benchmark.extra_info["sim_seconds_per_wall_second_with_metrics"] = sim_seconds / (
        best + metrics_seconds)
    benchmark.extra_info["peak_rss_mb"] = child["peak_rss_mb"]
    benchmark.extra_info["rss_after_import_mb"] = child["rss_after_import_mb"]


def test_bench_million_requests(benchmark):
    """default.yaml at 40 requests/s, 1,000,000 requests: under 2 GB (issue 25 item 17)."""
    if benchmark.disabled:
        pytest.skip("a few minutes: run with --benchmark-enable")
    spec = {"file": "scenarios/default.yaml", "set": MILLION, "trace": "sample"}
    child = benchmark.pedantic(run_child, args=(spec,), rounds=1, iterations=1)
    assert child["completed"] == 1_000_000
    assert child["spans_kept"] <= 100_000 < child["spans_seen"]
    assert child["peak_rss_mb"] < 2048
    for key in ("wall_s", "cpu_s", "metrics_s", "sim_seconds", "peak_rss_mb",
                "rss_after_import_mb", "spans_seen", "spans_kept"):
        benchmark.extra_info[key] = child[key]
    benchmark.extra_info["sim_seconds_per_wall_second"] = child["sim_seconds"] / child["wall_s"]
