"""Does the model's answer make physical sense? Load raises latency; a separate correction
is one extra target forward per round; a CPU draft pays CPU memory bandwidth; a
disaggregated request pays its KV transfer; the roofline answers batch and context."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.hardware import load_hardware
from kestrel_sim.metrics import compute_metrics
from kestrel_sim.models import preset
from kestrel_sim.scenario import Scenario

H200 = load_hardware("h200")
TARGET = RooflineCost(H200, preset("qwen3-8b"))


def scenario(rate: float = 4.0, requests: int = 150, **over) -> Scenario:
    data = {
        "name": "physics",
        "draft": {"model": "qwen3-0.6b"},
        "spec": {"k": 4, "correction": "fused", "acceptance": {"alpha": 0.7}},
        "workload": {
            "arrivals": {"process": "poisson", "rate": rate}, "requests": requests,
            "prompt_tokens": {"dist": "uniform", "low": 256, "high": 1024},
            "output_tokens": {"dist": "uniform", "low": 32, "high": 128}, "seed": 1,
        },
    }
    data.update(over)
    return Scenario.load_from_dict(data)


def test_more_load_raises_latency_and_saturates_throughput():
    runs = [compute_metrics(simulate(scenario(rate, 300))) for rate in (2, 20, 80, 200)]
    for name in ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms"):
        values = [getattr(m, name) for m in runs]
        # nondecreasing (saturated runs tie: the batch is full either way)
        assert all(b >= 0.99 * a for a, b in itertools.pairwise(values)), (name, values)
        assert values[-1] > 2 * values[0], (name, values)
    assert runs[-1].mean_e2el_ms > 3 * runs[0].mean_e2el_ms
    assert runs[-1].request_throughput < 0.8 * 200  # saturated: served below the offered rate


def test_separate_correction_is_one_extra_target_forward_every_round():
    tr = simulate(scenario(spec={"k": 4, "correction": "separate",
                                 "acceptance": {"alpha": 0.7}}))
    verify = [s for s in tr.spans if s.kind == "verify"]
    correction = {(s.worker, s.start): s for s in tr.spans if s.kind == "correction"}
    assert len(correction) == len(verify)
    for v in verify:
        c = correction[(v.worker, v.end)]  # right after the verify, on the target
        b = len(v.requests)
        assert c.requests == v.requests and c.tokens == b  # one token per sequence
        expected = TARGET.seconds("correction", b, 1, (v.context + sum(v.accepted)) / b)
        assert c.end - c.start == pytest.approx(expected)
    fused = compute_metrics(simulate(scenario()))
    separate = compute_metrics(tr)
    assert separate.mean_tpot_ms > 1.3 * fused.mean_tpot_ms
    assert not [s for s in simulate(scenario()).spans if s.kind == "correction"]


def test_cpu_draft_pays_cpu_memory_bandwidth():
    cpu = load_hardware("cpu-xeon")
    tr = simulate(scenario(draft={"model": "qwen3-0.6b", "device": "cpu"}))
    drafts = [s for s in tr.spans if s.kind == "draft"]
    assert {s.worker for s in drafts} == {"gpu0/cpu-draft"}
    weights = RooflineCost(cpu, preset("qwen3-0.6b")).weight_bytes
    floor = weights / (cpu.mem_bandwidth_tb_s * 1e12)  # every step reads every weight once
    assert min(s.end - s.start for s in drafts) >= floor
    gpu = simulate(scenario())
    gpu_draft = np.mean([s.end - s.start for s in gpu.spans if s.kind == "draft"])
    assert np.mean([s.end - s.start for s in drafts]) > 5 * gpu_draft  # ~17x less bandwidth


def test_disaggregated_requests_pay_their_kv_transfer():
    def run(bandwidth: float):
        serving = {"mode": "disaggregated", "link": {"bandwidth_gb_s": bandwidth}}
        return simulate(scenario(0.5, 30, serving=serving))  # light load: no queueing

    fast, slow = run(1000.0), run(2.0)
    moved = {s.requests[0]: s.end - s.start for s in slow.spans if s.kind == "kv_transfer"}
    moved_fast = {s.requests[0]: s.end - s.start for s in fast.spans if s.kind == "kv_transfer"}
    extra = []
    for r_fast, r_slow in zip(fast.requests, slow.requests):
        extra.append(moved[r_slow.id] - moved_fast[r_fast.id])
        assert extra[-1] > 0.03  # 67 to 270 MB of KV at 2 GB/s
        if r_slow.output_tokens > 1:  # the first token reaches the client with the KV
            ttft = [r.emit_times[0] - r.arrival for r in (r_fast, r_slow)]
            assert ttft[1] - ttft[0] >= extra[-1] - 1e-9  # (more where it queued for the link)
    e2el = [compute_metrics(t).mean_e2el_ms * 1e-3 for t in (fast, slow)]
    assert e2el[1] - e2el[0] >= 0.9 * np.mean(extra)


def test_roofline_answers_batch_and_context():
    decode = [TARGET.seconds("decode", b, 1, 1024) for b in (1, 8, 64, 256)]
    assert decode == sorted(decode)
    assert decode[1] < 1.1 * decode[0]  # memory-bound: 8 sequences cost about one
    assert decode[3] > 1.5 * decode[0]  # KV reads and flops catch up
    ctx = [TARGET.seconds("decode", 32, 1, c) for c in (0, 4096, 32768)]
    assert ctx == sorted(ctx) and ctx[2] > 2 * ctx[0]
    # a verify of k+1 positions costs about one decode step when memory-bound
    assert TARGET.seconds("verify", 1, 5, 1024) < 1.1 * TARGET.seconds("decode", 1, 1, 1024)
