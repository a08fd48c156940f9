"""The interleaving law of contention (kestrel_sim/costs/interleave.py): fitted from overlap
rows it recovers a known law, fit_contention keeps the law that predicts the rows better
held out, and the shared device slows steps by it."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from kestrel_sim.costs.base import Shares
from kestrel_sim.costs.contention import Contention, OverlapRow, fit_contention, predict
from kestrel_sim.costs.interleave import Ratio, fit_ratio, ratio_slowdowns
from kestrel_sim.sim.device import SharedDevice

MEMORY = Shares(0.8, 0.02, 0.8, 0.02)  # a decode step's use of the device
COMPUTE = Shares(0.1, 0.95, 0.03, 0.95)  # a prefill chunk's
LAW = {"decode": Ratio(0.55, 0.8), "prefill": Ratio(1.2, 0.8)}


def rows_of(law, noise: float = 0.0, seed: int = 0) -> list[OverlapRow]:
    """Overlap rows both ways round, slowed by `law` (a dict of Ratio per side, or a lam
    per side for the shares law), times a lognormal noise."""
    rng = np.random.default_rng(seed)
    out = []
    for decode_ms in (5.0, 10.0, 12.0, 40.0):
        for prefill_ms in (16.0, 56.0):
            for side, own, other, sh, osh in (("decode", decode_ms, prefill_ms, MEMORY, COMPUTE),
                                              ("prefill", prefill_ms, decode_ms, COMPUTE, MEMORY)):
                row = OverlapRow(sh, osh, side, 1.0, own, other)
                if isinstance(law[side], Ratio):
                    f = 1.0 + law[side].excess(own, other)
                else:
                    f = predict(row, law[side])
                row.observed = f * float(np.exp(rng.normal(0.0, noise)))
                out.append(row)
    return out


def test_the_ratio_fit_recovers_its_law_and_needs_two_ratios():
    rows = [r for r in rows_of(LAW) if r.side == "decode"]
    got = fit_ratio([r.pair() for r in rows])
    assert got.a == pytest.approx(0.55, rel=1e-6) and got.b == pytest.approx(0.8, rel=1e-6)
    assert fit_ratio([(5.0, 16.0, 2.0)]) is None
    assert fit_ratio([(5.0, 16.0, 2.0), (10.0, 32.0, 3.0)]) is None  # one ratio of times


def test_slowdowns_grow_with_the_other_steps_length_and_alone_are_one():
    assert ratio_slowdowns([5.0], ["decode"], LAW) == [1.0]
    short, long = (ratio_slowdowns([5.0, p], ["decode", "prefill"], LAW)[0] for p in (16, 56))
    assert 1.0 < short < long
    f_decode, f_prefill = ratio_slowdowns([5.0, 56.0], ["decode", "prefill"], LAW)
    assert f_decode == pytest.approx(1 + 0.55 * (56 / 5) ** 0.8)
    assert f_prefill == pytest.approx(1 + 1.2 * (5 / 56) ** 0.8)


def test_fit_contention_keeps_the_law_that_predicts_held_out_rows_better():
    interleaved = fit_contention(rows_of(LAW, noise=0.02))
    assert interleaved.law == "interleave" and interleaved.fitted
    assert interleaved.ratio["decode"].b == pytest.approx(0.8, abs=0.15)
    assert interleaved.law_held_out["interleave"] < interleaved.law_held_out["shares"]
    assert "slowed by the other's kernels" in interleaved.describe()
    # rows slowed by the shares law, their steps' shares varied and their times not tied
    # to them: the interleaving law cannot follow them
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(16):
        mem = rng.uniform(0.1, 0.9)
        own = Shares(mem, 1 - mem, mem, 1 - mem)
        other = COMPUTE if rng.random() < 0.5 else MEMORY
        side = "decode" if rng.random() < 0.5 else "prefill"
        row = OverlapRow(own, other, side, 1.0, rng.uniform(5, 60), rng.uniform(5, 60))
        row.observed = predict(row, {"decode": 0.3, "prefill": 0.7}[side])
        rows.append(row)
    shared = fit_contention(rows)
    assert shared.law == "shares"
    assert shared.serial["decode"] == pytest.approx(0.3, abs=0.02)
    # rows that do not price both steps' times: the shares law alone
    unpriced = [OverlapRow(r.timed, r.other, r.side, r.observed) for r in rows_of(LAW)]
    assert fit_contention(unpriced).law == "shares"


def test_the_shared_device_slows_overlapping_steps_by_the_law():
    env = simpy.Environment()
    dev = SharedDevice(env, Contention(law="interleave", ratio=LAW, rows=16))
    ends = {}

    def step(name, seconds, shares, side):
        job = dev.run(seconds, shares, side)
        yield job.done
        ends[name] = env.now

    env.process(step("decode", 0.005, MEMORY, "decode"))
    env.process(step("prefill", 0.056, COMPUTE, "prefill"))
    env.run()
    f = 1 + 0.55 * (56 / 5) ** 0.8  # the decode step, the whole of it beside the chunk
    assert ends["decode"] == pytest.approx(0.005 * f)
    assert 0.056 < ends["prefill"] < 0.056 * (1 + 1.2 * (5 / 56) ** 0.8)
