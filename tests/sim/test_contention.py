"""Steps of workers that share one device (serving.devices) slow each other where they
overlap: the contention model (kestrel_sim/costs/contention.py) and the device that runs
it (kestrel_sim/sim/device.py), alone and inside whole simulated runs."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import simpy

from kestrel_sim import simulate
from kestrel_sim.costs.base import BUSY, Shares, blend
from kestrel_sim.costs.build import build_costs, describe_costs
from kestrel_sim.costs.contention import DEFAULT_SERIAL, Contention, bounds, slowdowns
from kestrel_sim.scenario import Scenario
from kestrel_sim.sim.device import SharedDevice

MEMORY = Shares(bandwidth=0.9, compute=0.05, memory_bound=0.9, compute_bound=0.05)
COMPUTE = Shares(bandwidth=0.1, compute=0.85, memory_bound=0.0, compute_bound=0.85)


def disaggregated(shared: bool, **workload) -> Scenario:
    wl = {"arrivals": {"process": "poisson", "rate": 8.0}, "requests": 120,
          "prompt_tokens": {"dist": "uniform", "low": 1000, "high": 3000},
          "output_tokens": {"dist": "uniform", "low": 64, "high": 192}, "seed": 3}
    wl.update(workload)
    return Scenario.load_from_dict({
        "name": "shared", "hardware": "h200", "model": "qwen3-8b",
        "serving": {"mode": "disaggregated", "max_batch": 64, "max_batched_tokens": 8192,
                    "prefill_chunk": 2048, "link": "nvlink",
                    "devices": ["cuda:0"] if shared else ["cuda:0", "cuda:1"]},
        "workload": wl,
    })


def step_times(run, kind: str, worker: str) -> np.ndarray:
    return np.array([s.end - s.start for s in run.spans if s.kind == kind and s.worker == worker])


# ---------------------------------------------------------------- the model


def test_a_step_alone_is_not_slowed():
    assert slowdowns([MEMORY], [1.0]) == [1.0]
    assert slowdowns([MEMORY, Shares(0, 0, 0, 0)], [0.5, 0.5])[0] == pytest.approx(1.0)


def test_memory_and_compute_bound_pair_slows_less_than_two_memory_bound_steps():
    for lam in (0.0, 0.25, DEFAULT_SERIAL, 0.9):
        mixed = slowdowns([MEMORY, COMPUTE], [lam, lam])
        two = slowdowns([MEMORY, MEMORY], [lam, lam])
        assert mixed[0] < two[0] and mixed[1] < two[0]
    # ideal sharing: neither resource oversubscribed, so neither step slows
    assert slowdowns([MEMORY, COMPUTE], [0.0, 0.0]) == pytest.approx([1.0, 1.0])
    # two memory-bound steps: the memory-bound part stretched by the bandwidth asked for
    # (1.8 of it), the compute-bound part not (0.1 asked); one at a time: the busy part by 1.9
    ideal, serial = bounds([MEMORY, MEMORY], 0)
    assert ideal == pytest.approx(0.05 + 0.9 * 1.8 + 0.05)
    assert serial == pytest.approx(0.05 + 0.95 * 1.9)


def test_slowdown_grows_with_serialisation_and_stays_within_its_bounds():
    ideal, serial = bounds([MEMORY, COMPUTE], 0)
    fs = [slowdowns([MEMORY, COMPUTE], [lam, 0.0])[0] for lam in np.linspace(0, 1, 11)]
    assert all(a <= b for a, b in pairwise(fs))
    assert fs[0] == pytest.approx(ideal) and fs[-1] == pytest.approx(serial)
    assert slowdowns([BUSY, BUSY], [0.3, 0.7]) == pytest.approx([2.0, 2.0])  # no split: time


def test_blend_weights_parts_by_their_time():
    sh = blend([(3.0, MEMORY), (1.0, COMPUTE)])
    assert sh.bandwidth == pytest.approx((3 * 0.9 + 0.1) / 4)
    assert sh.compute_bound == pytest.approx((3 * 0.05 + 0.85) / 4)


# ---------------------------------------------------------------- the device


def run_jobs(starts: list[tuple[float, float, Shares, str]], lam: float = 0.5):
    """Jobs (start, seconds, shares, side) on one SharedDevice; their end times."""
    env = simpy.Environment()
    dev = SharedDevice(env, Contention(serial={"decode": lam, "prefill": lam}))
    ends = [None] * len(starts)

    def one(i, start, seconds, shares, side):
        yield env.timeout(start)
        job = dev.run(seconds, shares, side)
        yield job.done
        ends[i] = env.now

    for i, job in enumerate(starts):
        env.process(one(i, *job))
    env.run()
    return ends


def test_a_job_that_never_overlaps_ends_exactly_its_time_later():
    ends = run_jobs([(0.1, 0.0123, MEMORY, "decode"), (0.2, 0.0456, COMPUTE, "prefill")])
    assert ends == [0.1 + 0.0123, 0.2 + 0.0456]


def test_overlapping_jobs_follow_the_fluid_model():
    f = slowdowns([MEMORY, MEMORY], [0.5, 0.5])[0]
    # both start together: both end at f times their time
    ends = run_jobs([(0.0, 1.0, MEMORY, "decode"), (0.0, 1.0, MEMORY, "decode")])
    assert ends == pytest.approx([f, f])
    # the second starts half-way through the first and is twice as long
    ends = run_jobs([(0.0, 1.0, MEMORY, "decode"), (0.5, 2.0, MEMORY, "decode")])
    a_end = 0.5 + 0.5 * f  # its last half second alone, stretched by f
    b_done = (a_end - 0.5) / f  # of b's time alone, run while a was active
    assert ends[0] == pytest.approx(a_end)
    assert ends[1] == pytest.approx(a_end + (2.0 - b_done))


def test_decode_slows_less_beside_compute_bound_prefill_than_beside_decode():
    beside_decode = run_jobs([(0.0, 1.0, MEMORY, "decode"), (0.0, 5.0, MEMORY, "decode")])
    beside_prefill = run_jobs([(0.0, 1.0, MEMORY, "decode"), (0.0, 5.0, COMPUTE, "prefill")])
    assert 1.0 < beside_prefill[0] < beside_decode[0]


# ---------------------------------------------------------------- whole runs


def test_shared_device_is_slower_under_overlap():
    apart, shared = simulate(disaggregated(False)), simulate(disaggregated(True))
    assert apart.meta["placement"] == {"prefill0": "cuda:0", "decode0": "cuda:1"}
    assert shared.meta["placement"] == {"prefill0": "cuda:0", "decode0": "cuda:0"}
    for kind, worker in (("decode", "decode0/target"), ("prefill", "prefill0/target")):
        a, s = step_times(apart, kind, worker), step_times(shared, kind, worker)
        assert s.mean() > 1.05 * a.mean()
    assert shared.metrics.median_tpot_ms > 1.05 * apart.metrics.median_tpot_ms
    assert shared.metrics.median_ttft_ms > apart.metrics.median_ttft_ms
    assert shared.metrics.completed == apart.metrics.completed == 120


def test_shared_device_changes_nothing_when_steps_never_overlap():
    # one client at a time: a request is prefilled, handed over and decoded before the next
    closed = {"arrivals": {"process": "closed", "concurrency": 1}, "requests": 12}
    apart, shared = (simulate(disaggregated(s, **closed), trace="full") for s in (False, True))
    assert [(s.kind, s.worker, s.start, s.end) for s in shared.spans] == [
        (s.kind, s.worker, s.start, s.end) for s in apart.spans]
    assert shared.metrics == apart.metrics


def test_spans_of_stretched_steps_stay_in_order_and_inside_their_step():
    run = simulate(disaggregated(True), trace="full")
    for worker in ("decode0/target", "prefill0/target"):
        spans = [s for s in run.spans if s.worker == worker]
        assert all(s.start <= s.end for s in spans)
        assert all(a.end <= b.start + 1e-12 for a, b in pairwise(spans))


def test_shared_device_runs_are_deterministic():
    a, b = simulate(disaggregated(True), trace="full"), simulate(disaggregated(True), trace="full")
    assert [(s.start, s.end) for s in a.spans] == [(s.start, s.end) for s in b.spans]
    assert a.metrics == b.metrics


def test_speculative_rounds_and_colocated_workers_share_a_device():
    data = disaggregated(True).model_dump(mode="json")
    data.update(draft={"model": "qwen3-0.6b", "device": "gpu"},
                spec={"k": 4, "correction": "separate", "acceptance": {"alpha": 0.7}})
    colocated = {"mode": "colocated", "workers": 2, "devices": ["cuda:0", "cuda:0"]}
    sc = Scenario.load_from_dict({**data, "serving": colocated})
    apart = Scenario.load_from_dict({**data, "serving": {**colocated, "devices": None}})
    assert simulate(sc).metrics.median_tpot_ms > 1.05 * simulate(apart).metrics.median_tpot_ms

    def stretch(draft_device: str) -> float:
        """Mean prefill step on one device over that on two, the draft on draft_device."""
        times = []
        for devices in (["cuda:0"], ["cuda:0", "cuda:1"]):
            run = simulate(Scenario.load_from_dict({
                **data, "draft": {"model": "qwen3-0.6b", "device": draft_device},
                "serving": {**data["serving"], "devices": devices}}), trace="full")
            assert run.metrics.completed == 120
            times.append(step_times(run, "prefill", "prefill0/target").mean())
        return times[0] / times[1]

    # a CPU draft's rounds are mostly CPU time: they leave the GPU to the prefill worker
    assert stretch("gpu") > 1.1 > stretch("cpu") >= 1.0


def test_the_cost_description_says_how_contention_is_priced():
    costs = build_costs(disaggregated(True), np.random.default_rng(0))
    text = describe_costs(costs)
    assert text.startswith("uncalibrated roofline (h200); ")
    assert "uncalibrated contention, lam decode 0.50, prefill 0.50" in text
    assert describe_costs(build_costs(disaggregated(False), np.random.default_rng(0))) == (
        "uncalibrated roofline (h200)")
