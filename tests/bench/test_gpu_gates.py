"""Regression gates on the GPU: decode step, verify and speculative round times of qwen3-8b
with a qwen3-0.6b draft (bench/regression/gpu_gates.py), against the milliseconds recorded
on an H200 in bench/regression/baselines/gpu_h200.json. Marked `gpu` (skipped without CUDA);
judged only with --benchmark-enable, on the baseline's device, once a baseline is recorded:

    python -m pytest tests/bench -m gpu --benchmark-enable                       # judge
    KESTREL_UPDATE_BASELINES=1 python -m pytest tests/bench -m gpu --benchmark-enable  # record
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "regression"))

import baseline

BASELINES = baseline.load("gpu_h200")


@pytest.fixture(scope="module")
def measured():
    import gpu_gates

    return gpu_gates.measure_all()  # (gate -> ms, device name): one build for every gate


@pytest.mark.gpu
@pytest.mark.parametrize("gate", list(BASELINES["baselines"]))
def test_gpu_gate(benchmark, measured, gate):
    if benchmark.disabled:
        pytest.skip("a GPU gate: run with --benchmark-enable")
    times, device = measured
    ms = times[gate]
    benchmark.extra_info.update({"ms": ms, "device": device})
    benchmark.pedantic(lambda: ms, rounds=1, iterations=1)  # the number, in the saved run
    if baseline.updating():
        baseline.record("gpu_h200", gate, round(ms, 4), {"device": device})
        return
    if BASELINES["device"].lower() not in device.lower():
        pytest.skip(f"baselines are of a {BASELINES['device']}, this is a {device}")
    base = BASELINES["baselines"][gate]
    if base is None:
        pytest.skip(f"no baseline for {gate} yet: record it on the {BASELINES['device']} "
                    f"with {baseline.UPDATE_ENV}=1")
    ok, line = baseline.judge(ms, base, BASELINES["margin"])
    benchmark.extra_info["verdict"] = line
    assert ok, f"{gate} is slower: {line} ms"


def test_the_gates_code_path_on_the_cpu(tmp_path):
    """The same measurement on the CPU with a tiny model folder (target and draft): every
    gate gets a positive time (what it would be on the GPU is the H200's to say)."""
    pytest.importorskip("torch")
    import gpu_gates
    from tiny_models import build

    folder = build("tied", tmp_path / "tiny")
    models = gpu_gates.build("cpu", str(folder), str(folder), context=16, round_tokens=24)
    times = gpu_gates.step_times(models, warmup=1, repeats=2, context=16)
    times |= gpu_gates.round_times(models, context=16, round_tokens=24)
    assert set(times) == set(BASELINES["baselines"])
    assert all(ms > 0 for ms in times.values())
