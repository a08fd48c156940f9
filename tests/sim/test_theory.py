"""The simulator against theory: Leviathan's closed form, M/M/1 and M/D/1 waits, Little's law."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.acceptance import leviathan_tokens
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.scenario import Scenario


def scenario(**over) -> Scenario:
    data = {
        "name": "theory",
        "model": "qwen3-8b",
        "workload": {
            "arrivals": {"process": "poisson", "rate": 1.0},
            "requests": 1,
            "prompt_tokens": {"dist": "fixed", "value": 16},
            "output_tokens": {"dist": "fixed", "value": 1},
            "seed": 0,
        },
    }
    for key, value in over.items():
        node = data
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return Scenario.load_from_dict(data)


def decode_throughput(trace) -> float:
    """Tokens per second after the first token, of a single request."""
    (r,) = trace.requests
    return (r.output_tokens - 1) / (r.finish - r.emit_times[0])


@pytest.mark.parametrize("correction", ["separate", "fused"])
@pytest.mark.parametrize("alpha,k", [(0.6, 4), (0.8, 2), (0.3, 8)])
def test_single_stream_equals_leviathan_closed_form(alpha, k, correction):
    table = {"prefill": 1.0, "draft": 0.6, "verify": 2.0, "correction": 1.1}
    sc = scenario(**{
        "draft": {"model": "qwen3-0.6b"},
        "spec": {"k": k, "correction": correction, "acceptance": {"alpha": alpha}},
        "costs": {"table": table},
        "workload.output_tokens": {"dist": "fixed", "value": 40_001},  # within the context
    })
    round_ms = k * table["draft"] + table["verify"]
    round_ms += table["correction"] if correction == "separate" else 0.0
    expected = leviathan_tokens(alpha, k) / (round_ms * 1e-3)
    measured = decode_throughput(simulate(sc))
    assert measured == pytest.approx(expected, rel=0.01)


def test_single_stream_roofline_closed_form():
    """With the roofline (round time grows with context, linearly at batch 1), the closed
    form at the mid-run context holds within 1%."""
    prompt, output, k, alpha = 1024, 39_001, 4, 0.7  # within the 40,960 context
    sc = scenario(**{
        "draft": {"model": "qwen3-0.6b"},
        "spec": {"k": k, "correction": "fused", "acceptance": {"alpha": alpha}},
        "workload.prompt_tokens": {"dist": "fixed", "value": prompt},
        "workload.output_tokens": {"dist": "fixed", "value": output},
    })
    hw = load_hardware("h200")
    target, draft = RooflineCost(hw, preset("qwen3-8b")), RooflineCost(hw, preset("qwen3-0.6b"))
    mid = prompt + output / 2
    round_s = k * draft.seconds("draft", 1, 1, mid) + target.seconds("verify", 1, k + 1, mid)
    expected = leviathan_tokens(alpha, k) / round_s
    assert decode_throughput(simulate(sc)) == pytest.approx(expected, rel=0.01)


def test_plain_decode_single_stream():
    sc = scenario(**{
        "costs": {"table": {"prefill": 1.0, "decode": 4.0}},
        "workload.output_tokens": {"dist": "fixed", "value": 1001},
    })
    assert decode_throughput(simulate(sc)) == pytest.approx(250.0, rel=1e-9)


def mean_wait(service: str, rho: float, s_ms: float, n: int, seed: int) -> float:
    sc = scenario(**{
        "serving": {"max_batch": 1},
        "costs": {"table": {"prefill": s_ms, "decode": 1.0, "service": service}},
        "workload.arrivals": {"process": "poisson", "rate": rho / (s_ms * 1e-3)},
        "workload.requests": n,
        "workload.seed": seed,
    })
    rec = simulate(sc, trace="none").recorder  # every request's times, no trace kept
    return float(np.mean(rec.view("prefill_start") - rec.view("arrival")))


def test_mm1_mean_wait():
    rho, s = 0.5, 10.0
    expected = rho * s * 1e-3 / (1 - rho)  # Wq = rho / (mu - lambda)
    assert mean_wait("exponential", rho, s, 150_000, seed=1) == pytest.approx(expected, rel=0.03)


def test_md1_mean_wait():
    rho, s = 0.6, 10.0
    expected = rho * s * 1e-3 / (2 * (1 - rho))  # Pollaczek-Khinchine, deterministic service
    assert mean_wait("fixed", rho, s, 80_000, seed=2) == pytest.approx(expected, rel=0.03)


def test_littles_law_on_a_loaded_run():
    sc = scenario(**{
        "draft": {"model": "qwen3-0.6b"},
        "spec": {"k": 4, "correction": "separate", "acceptance": {"alpha": 0.6}},
        "workload.arrivals": {"process": "poisson", "rate": 40.0},
        "workload.requests": 1500,
        "workload.prompt_tokens": {"dist": "uniform", "low": 64, "high": 1024},
        "workload.output_tokens": {"dist": "uniform", "low": 16, "high": 256},
    })
    tr = simulate(sc)
    arr = np.array([r.arrival for r in tr.requests])
    fin = np.array([r.finish for r in tr.requests])
    assert (fin > arr).all()
    # time-average number in system, integrated from the event times
    times = np.concatenate((arr, fin))
    steps = np.concatenate((np.ones_like(arr), -np.ones_like(fin)))
    order = np.argsort(times, kind="stable")
    times, in_system = times[order], np.cumsum(steps[order])
    horizon = fin.max() - arr.min()
    mean_in_system = np.sum(in_system[:-1] * np.diff(times)) / horizon
    throughput = len(arr) / horizon
    mean_time = float(np.mean(fin - arr))
    assert in_system.max() > 10  # the run is loaded: requests queue and batch
    assert mean_in_system == pytest.approx(throughput * mean_time, rel=1e-3)
