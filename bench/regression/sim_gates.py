"""The simulator's speed gates: fixed workloads, each timed against the reference workload
(reference.py) in the same process, interleaved, best of several rounds.

    ratio = min(CPU seconds of the workload) / min(CPU seconds of the reference)

A gate fails when its ratio passes its baseline (baselines/sim_speed.json) by more than
the stated margin. tests/bench/test_sim_speed_gate.py runs them under pytest-benchmark.
Each workload returns a callable to time and the number it should reproduce (a check that
the work is the same work: completed requests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from reference import reference_workload

from kestrel_sim.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "calibration" / "profiles" / "qwen3-8b_h200.json"


def _scenario(requests: int, **parts) -> Scenario:
    data = {
        "name": "gate", "hardware": "h200", "model": "qwen3-8b",
        "serving": {"mode": "colocated", "max_batch": 64, "max_batched_tokens": 8192,
                    "prefill_chunk": 2048},
        "workload": {"arrivals": {"process": "poisson", "rate": 60.0}, "requests": requests,
                     "prompt_tokens": {"dist": "uniform", "low": 128, "high": 1024},
                     "output_tokens": {"dist": "uniform", "low": 64, "high": 512}, "seed": 0},
    }
    data.update(parts)
    return Scenario.load_from_dict(data)


SPEC = {"draft": {"model": "qwen3-0.6b", "device": "gpu"},
        "spec": {"k": 4, "correction": "separate", "acceptance": {"alpha": 0.6}}}
DISAGG = {"mode": "disaggregated", "prefill_workers": 2, "decode_workers": 2, "max_batch": 64,
          "max_batched_tokens": 8192, "prefill_chunk": 2048}
LOGNORMAL = {"arrivals": {"process": "poisson", "rate": 60.0},
             "prompt_tokens": {"dist": "lognormal", "mean": 1200, "std": 900, "max": 8000},
             "output_tokens": {"dist": "uniform", "low": 32, "high": 512}, "seed": 0}


def _simulate(sc: Scenario) -> tuple[Callable[[], object], int]:
    from kestrel_sim import simulate

    return (lambda: simulate(sc, trace="none")), sc.workload.requests


def saturated_spec_roofline(scale: float) -> tuple[Callable[[], object], int]:
    """Colocated, speculative (k 4, separate), twice what the GPU serves: full batches."""
    return _simulate(_scenario(int(1500 * scale), **SPEC))


def saturated_spec_profile(scale: float) -> tuple[Callable[[], object], int]:
    """The same, priced by the bundled H200 profile (the profile fit's step pricing)."""
    return _simulate(_scenario(int(1000 * scale), **SPEC, costs={"profile": str(PROFILE)}))


def disaggregated_mixed_lengths(scale: float) -> tuple[Callable[[], object], int]:
    """Two prefill and two decode workers, lognormal prompts, KV transfers, no draft."""
    n = int(1500 * scale)
    return _simulate(_scenario(n, serving=DISAGG, workload={**LOGNORMAL, "requests": n}))


def metrics_of_a_run(scale: float) -> tuple[Callable[[], object], int]:
    """Metrics and time series of a finished saturated run of 4000 requests, from its
    Recorder, three times over (one takes a few tens of milliseconds)."""
    from kestrel_sim import simulate
    from kestrel_sim.metrics import metrics_from
    from kestrel_sim.timeseries import compute_timeseries

    sc = _scenario(int(4000 * scale), **SPEC)
    run = simulate(sc, trace="none")

    def work():
        for _ in range(3):
            compute_timeseries(run)
            metrics = metrics_from(run.recorder, sc.slo)
        return metrics

    return work, sc.workload.requests


WORKLOADS: dict[str, Callable[[float], tuple[Callable[[], object], int]]] = {
    "saturated_spec_roofline": saturated_spec_roofline,
    "saturated_spec_profile": saturated_spec_profile,
    "disaggregated_mixed_lengths": disaggregated_mixed_lengths,
    "metrics_of_a_run": metrics_of_a_run,
}


def completed(result) -> int:
    metrics = getattr(result, "metrics", result)
    return metrics.completed


class Interleaved:
    """Times the reference before each round of a workload (pytest-benchmark's `setup`
    hook runs it, untimed by the benchmark) and the workload itself, both in CPU seconds of
    this process (time.process_time: time the process waits for a core, on a shared
    machine, is not counted; the benchmark's own table keeps wall time)."""

    def __init__(self, work: Callable[[], object], reference_events: int):
        self.work = work
        self.events = reference_events
        self.reference: list[float] = []
        self.workload: list[float] = []

    def setup(self) -> None:
        t0 = time.process_time()
        reference_workload(self.events)
        self.reference.append(time.process_time() - t0)

    def run(self) -> object:
        t0 = time.process_time()
        result = self.work()
        self.workload.append(time.process_time() - t0)
        return result

    def ratio(self) -> float:
        """Best workload time over best reference time."""
        return min(self.workload) / min(self.reference)
