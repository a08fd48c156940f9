"""The simulator draws each request's accepted lengths from that request's own stream,
accept_rng(seed, request), as the runtime's controlled acceptance does: round j of request r
takes the j-th uniform of its generator, whichever requests share its batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from accepted_lengths import per_request

from kestrel_sim import simulate
from kestrel_sim.acceptance import (
    WINDOW,
    RequestAcceptance,
    accept_rng,
    build_acceptance,
)
from kestrel_sim.scenario import Acceptance, load_scenario
from kestrel_sim.sim.batch import RunningBatch

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios/validation/spec-k4-separate.yaml"


def run(rate: float, requests: int = 40):
    sc = load_scenario(SCENARIO, [f"workload.arrivals.rate={rate}",
                                  f"workload.requests={requests}", "workload.seed=7"])
    return sc, simulate(sc, trace="full")


def test_block_of_uniforms_equals_one_at_a_time():
    """rng.random(n) is n calls of rng.random(1); advance(m) skips m of them."""
    for seed in (0, 7, 2**64 - 3):
        block = accept_rng(seed, 5).random(100)
        rng = accept_rng(seed, 5)
        one = np.array([rng.random(1)[0] for _ in range(100)])
        assert np.array_equal(block, one)
        skipped = accept_rng(seed, 5)
        skipped.bit_generator.advance(37)
        assert np.array_equal(skipped.random(63), block[37:])


def test_seed_rule_wraps_and_matches_sampling():
    assert np.array_equal(accept_rng(2**64 - 1, 3).random(4), accept_rng(2, 0).random(4))
    assert not np.array_equal(accept_rng(0, 1).random(4), accept_rng(0, 2).random(4))


def test_simulated_lengths_follow_the_request_stream():
    """Without the runtime: the kept lengths are the stream's inverse-CDF draws, capped."""
    sc, sim = run(6.0)
    model, k = build_acceptance(sc.spec.acceptance, sc.spec.k), sc.spec.k
    seen = per_request(sim)
    outputs = {r.id: r.output_tokens for r in sim.requests}
    assert len(seen) == sc.workload.requests
    for rid, kept in seen.items():
        drawn = model.sample(len(kept), accept_rng(sc.workload.seed, rid))
        rem = outputs[rid] - 1  # the prefill emits the first token
        for n, d in zip(kept, drawn):
            assert n == min(int(d), k, rem - 1)
            rem -= n + 1
        assert rem == 0


def test_simulator_equals_runtime_controlled_draws():
    pytest.importorskip("torch")
    from kestrel_rt.sampling import SEED_RANGE as RT_SEED_RANGE
    from kestrel_rt.spec.controlled import ControlledAcceptance
    from kestrel_rt.spec.controlled import accept_rng as rt_accept_rng
    from kestrel_sim.acceptance import SEED_RANGE

    assert RT_SEED_RANGE == SEED_RANGE and rt_accept_rng is accept_rng
    sc, sim = run(6.0)
    seed, k = sc.workload.seed, sc.spec.k
    controlled = ControlledAcceptance(sc.spec.acceptance, k)
    outputs = {r.id: r.output_tokens for r in sim.requests}
    for rid, kept in per_request(sim).items():
        rng, rem = accept_rng(seed, rid), outputs[rid] - 1
        for n in kept:
            assert n == controlled.draw([rng], [min(k, rem - 1)])[0]
            rem -= n + 1


def test_draws_do_not_depend_on_the_batch():
    """Light and heavy load batch requests differently; each keeps the same lengths."""
    _, light = run(0.5)
    _, heavy = run(50.0)
    a, b = per_request(light), per_request(heavy)
    assert a == b
    sizes = [len(s.requests) for s in heavy.spans if s.kind == "verify"]
    assert max(sizes) > max(len(s.requests) for s in light.spans if s.kind == "verify")


def test_batch_gather_across_windows_preemption_and_order():
    """RunningBatch.accepted: each row its own next draw, across window refills, a row
    dropped and rejoined (preemption), and joins in any order."""
    model = build_acceptance(Acceptance(alpha=0.6), 4)
    rounds = 3 * WINDOW + 5
    want = {r: model.sample(rounds, accept_rng(11, r)) for r in range(6)}
    draws = RequestAcceptance(model, 11, 6)
    got: dict[int, list[int]] = {r: [] for r in range(6)}
    batch = RunningBatch()
    for r in (4, 0, 2):
        batch.join(r, 1, 10**6)
    for step in range(rounds):
        if step == 7:
            batch.join(5, 1, 10**6)
        if step == WINDOW + 3:  # preempt the newest (request 3), rejoin two rounds later
            popped = batch.pop_newest()
            assert popped[0] == 3
        if step == WINDOW + 5:
            batch.join(*popped)
        if step == 20:
            batch.join(1, 1, 10**6)
            batch.join(3, 1, 10**6)
        batch.merge()
        acc = batch.accepted(draws)
        for rid, n in zip(batch.ids.tolist(), acc.tolist()):
            got[rid].append(n)
        if step == 50:
            batch.keep(batch.ids != 0)  # request 0 finishes
    for r in range(6):
        assert got[r] == want[r][:len(got[r])].tolist()
        assert len(got[r]) == draws.used[r]
    assert len(got[4]) == rounds and len(got[3]) == rounds - 20 - 2 and len(got[0]) == 51
