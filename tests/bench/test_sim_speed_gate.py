"""Regression gates on the simulator's speed, as ratios to a fixed reference workload timed in
the same run (bench/regression/): a noisy or slow CPU scales both, the ratio stays.

    python -m pytest tests/bench --benchmark-enable                     # judge (fails past the margin)
    KESTREL_UPDATE_BASELINES=1 python -m pytest tests/bench --benchmark-enable   # re-record

Each gate times its workload with pytest-benchmark (rounds interleaved with the reference:
the benchmark's setup hook runs it) and fails when the ratio passes its baseline in
bench/regression/baselines/sim_speed.json by more than the file's margin. Without
--benchmark-enable (the test suite's default) each workload runs once at a tenth of its
size, as a smoke test of the gate, and nothing is judged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "regression"))

import baseline
import sim_gates
from reference import EVENTS

ROUNDS = 9


@pytest.mark.parametrize("gate", list(sim_gates.WORKLOADS))
def test_sim_speed_gate(benchmark, gate):
    make = sim_gates.WORKLOADS[gate]
    if benchmark.disabled:  # the suite's default: a smoke run, nothing timed or judged
        work, requests = make(0.1)
        assert sim_gates.completed(benchmark(work)) == requests
        return
    work, requests = make(1.0)
    clock = sim_gates.Interleaved(work, EVENTS)
    result = benchmark.pedantic(clock.run, setup=clock.setup, rounds=ROUNDS, iterations=1,
                                warmup_rounds=1)
    assert sim_gates.completed(result) == requests
    ratio = clock.ratio()
    benchmark.extra_info["ratio_to_reference"] = ratio
    benchmark.extra_info["reference_cpu_seconds"] = min(clock.reference)
    benchmark.extra_info["workload_cpu_seconds"] = min(clock.workload)
    if baseline.updating():
        baseline.record("sim_speed", gate, round(ratio, 4))
        return
    doc = baseline.load("sim_speed")
    base = doc["baselines"].get(gate)
    if base is None:
        pytest.skip(f"no baseline for {gate} yet: run with {baseline.UPDATE_ENV}=1 to record")
    ok, line = baseline.judge(ratio, base, doc["margin"])
    benchmark.extra_info["verdict"] = line
    assert ok, f"{gate} is slower: ratio {line}"
