"""Speed of a run whose workers share one device (serving.devices), against the same run on a
device per worker: the shared device adds a timeout or two per step, not one per token.

    python -m pytest tests/sim/test_contention_speed.py --benchmark-enable

extra_info: sim_seconds_per_cpu_second of the shared run (best of 5), and cpu_ratio, its CPU
seconds over those of the same scenario on two devices timed in the same test. Without
--benchmark-enable it runs once as a test, at a tenth of the size, and times nothing.
"""

from __future__ import annotations

import time

from kestrel_sim import simulate
from kestrel_sim.scenario import Scenario


def scenario(requests: int, devices: list[str]) -> Scenario:
    """Disaggregated 1 + 1 under saturation (twice what the prefill worker serves)."""
    return Scenario.load_from_dict({
        "name": "contention-speed", "hardware": "h200", "model": "qwen3-8b",
        "serving": {"mode": "disaggregated", "max_batch": 64, "max_batched_tokens": 8192,
                    "prefill_chunk": 2048, "link": "nvlink", "devices": devices},
        "workload": {"arrivals": {"process": "poisson", "rate": 60.0}, "requests": requests,
                     "prompt_tokens": {"dist": "lognormal", "mean": 1200, "std": 900,
                                       "max": 8000},
                     "output_tokens": {"dist": "uniform", "low": 32, "high": 512},
                     "seed": 0},
    })


def cpu_seconds(sc: Scenario) -> tuple[float, object]:
    t0 = time.process_time()
    run = simulate(sc, trace="none")
    return time.process_time() - t0, run


def test_bench_shared_device_run(benchmark):
    n = 150 if benchmark.disabled else 1500
    shared, apart = scenario(n, ["cuda:0"]), scenario(n, ["cuda:0", "cuda:1"])
    run = benchmark.pedantic(simulate, args=(shared,), kwargs={"trace": "none"},
                             rounds=1 if benchmark.disabled else 5, iterations=1)
    assert run.metrics.completed == n
    if benchmark.disabled:
        return
    shared_s = min(cpu_seconds(shared)[0] for _ in range(5))
    apart_s, other = min((cpu_seconds(apart) for _ in range(5)), key=lambda t: t[0])
    assert run.metrics.median_tpot_ms > other.metrics.median_tpot_ms
    benchmark.extra_info["sim_seconds_per_cpu_second"] = run.meta["end_time"] / shared_s
    benchmark.extra_info["cpu_ratio_to_two_devices"] = shared_s / apart_s
