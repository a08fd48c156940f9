"""The stage audit splits the steps that shared their GPU with another serving loop (a
disaggregated prefill and decode worker on one device) from those that ran alone: the audit
prices each step alone, so the simulator's own trace shows its contention law in exactly
those rows and nowhere else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_sim.costs.build import build_costs
from kestrel_sim.scenario import load_scenario
from kestrel_sim.sim.engine import simulate
from kestrel_sim.stage_audit import BESIDE, BESIDE_AT, base_kind, reprice, stage_audit
from kestrel_sim.trace import Span, Trace

ROOT = Path(__file__).resolve().parents[2]


def test_a_simulated_one_gpu_disaggregated_run_shows_its_contention_beside_only():
    sc = load_scenario(ROOT / "scenarios/validation/disaggregated-light.yaml",
                       ["workload.requests=16"])
    costs = build_costs(sc, np.random.default_rng(0))
    rows = stage_audit(simulate(sc, trace="full"), costs)
    alone = [r for r in rows if BESIDE not in r["stage"]]
    beside = [r for r in rows if BESIDE in r["stage"]]
    assert alone and beside
    for r in alone:  # priced as the simulator ran them (a round's draft steps: its context)
        assert r["beside"] < BESIDE_AT and r["error_pct"] == pytest.approx(0.0, abs=1.0), r
    for r in beside:  # slowed by the contention law: the audit's alone price is below
        assert r["beside"] >= BESIDE_AT and r["error_pct"] < -1.0, r
    again = reprice(rows, costs)  # a kept audit: its beside rows priced by their base stage
    assert [r["stage"] for r in again] == [r["stage"] for r in rows]
    assert base_kind("verify + prompt chunk" + BESIDE) == "verify"


def test_no_device_shared_no_beside_rows():
    sc = load_scenario(ROOT / "scenarios/validation/spec-k4-fused.yaml",
                       ["workload.requests=12"])
    rows = stage_audit(simulate(sc, trace="full"), build_costs(sc, np.random.default_rng(0)))
    assert rows and all("beside" not in r and BESIDE not in r["stage"] for r in rows)


def test_the_share_beside_is_the_time_the_other_loop_covered():
    from kestrel_sim.stage_audit import beside_shares

    spans = [Span("verify", "decode0/target", 0.0, 1.0, [0]),
             Span("prefill", "prefill0/target", 0.25, 0.5, [1]),
             Span("prefill", "prefill0/target", 0.4, 0.75, [2]),
             Span("verify", "decode0/target", 2.0, 3.0, [0])]
    trace = Trace(spans=spans, requests=[],
                  meta={"placement": {"prefill0": "cuda:0", "decode0": "cuda:0"}})
    got = beside_shares(trace, spans)
    assert got["decode0/target", 0.0, 1.0] == pytest.approx(0.5)  # 0.25..0.75 covered
    assert got["decode0/target", 2.0, 3.0] == 0.0
    assert got["prefill0/target", 0.25, 0.5] == pytest.approx(1.0)
    trace.meta["placement"] = {"prefill0": "cuda:0", "decode0": "cuda:1"}
    assert beside_shares(trace, spans) == {}
