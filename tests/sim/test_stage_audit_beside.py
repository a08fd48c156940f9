"""The stage audit splits the steps that shared their GPU with another serving loop (a
disaggregated prefill and decode worker on one device) from those that ran alone, and prices
them as the simulator charges them: their time alone stretched by the contention law over
the parts of their time the other loop's steps ran beside them (kestrel_sim/stage_contention.py).
The simulator's own trace, audited, prices at what it ran; a kept audit is priced from its
rows alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kestrel_sim.costs.base import BUSY
from kestrel_sim.costs.build import build_costs
from kestrel_sim.costs.contention import Contention
from kestrel_sim.costs.interleave import Ratio
from kestrel_sim.scenario import load_scenario
from kestrel_sim.sim.engine import simulate
from kestrel_sim.stage_audit import BESIDE, BESIDE_AT, base_kind, reprice, stage_audit, totals
from kestrel_sim.trace import Span, Trace

ROOT = Path(__file__).resolve().parents[2]
LAW = {"decode": Ratio(0.5, 0.7), "draft": Ratio(0.4, 0.7), "prefill": Ratio(1.0, 0.6)}
ALONE = {"prefill": 0.050, "draft": 0.001, "verify": 0.005}  # seconds, any shape


class FixedCost:
    """A stage cost of fixed times (ALONE), for hand-made traces."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def seconds(self, stage, batch, m, context):
        return ALONE[stage] * self.scale

    def mixed_seconds(self, stage, batch, m, context, chunk):
        return ALONE[stage] * self.scale

    def shares(self, stage, batch, m, context, chunk=None):
        return BUSY


def fixed_costs(scale: float = 1.0):
    return SimpleNamespace(target=FixedCost(scale), draft=FixedCost(scale), draft_hardware=None,
                           contention=Contention(law="interleave", ratio=LAW))


def one_gpu(spans: list[Span]) -> Trace:
    return Trace(spans=spans, requests=[],
                 meta={"placement": {"prefill0": "cuda:0", "decode0": "cuda:0"}})


def f(law: Ratio, own: float, other: float) -> float:
    return 1.0 + law.excess(own, other)


def test_a_step_beside_another_loop_is_charged_by_the_law_over_its_covered_part():
    draft = Span("draft", "decode0/draft", 0.010, 0.018, [0], 1, 2048)  # covered whole
    verify = Span("verify", "decode0/target", 0.040, 0.080, [0], 5, 2048, 4)  # half covered
    trace = one_gpu([Span("prefill", "prefill0/target", 0.0, 0.060, [1], 2048, 0), draft,
                     verify, Span("draft", "decode0/draft", 0.2, 0.201, [0], 1, 2048)])
    rows = {(r["worker"], r["stage"]): r for r in stage_audit(trace, fixed_costs())}
    fd = f(LAW["draft"], ALONE["draft"], ALONE["prefill"])
    got = rows["draft", "draft" + BESIDE]
    assert got["priced_ms"] == pytest.approx(ALONE["draft"] * fd * 1e3)
    assert got["alone_ms"] == pytest.approx(ALONE["draft"] * 1e3) and got["beside"] == 1.0
    fv = f(LAW["decode"], ALONE["verify"], ALONE["prefill"])
    got = rows["target", "verify" + BESIDE]
    assert got["priced_ms"] == pytest.approx(ALONE["verify"] / (0.5 + 0.5 / fv) * 1e3)
    assert rows["draft", "draft"]["priced_ms"] == pytest.approx(ALONE["draft"] * 1e3)
    fp = f(LAW["prefill"], ALONE["prefill"], ALONE["draft"])  # the chunk, beside each
    fpv = f(LAW["prefill"], ALONE["prefill"], ALONE["verify"])
    rate = 1 - (0.008 / 0.06) * (1 - 1 / fp) - (0.02 / 0.06) * (1 - 1 / fpv)
    got = rows["target", "prefill" + BESIDE]
    assert got["priced_ms"] == pytest.approx(ALONE["prefill"] / rate * 1e3)


def test_a_prefill_and_the_drafts_pass_after_it_weigh_as_one_job():
    """The simulator's prefill step is one job, the target's pass then the draft's: a step
    beside either is slowed as beside their sum."""
    trace = one_gpu([Span("prefill", "prefill0/target", 0.0, 0.05, [1], 2048, 0),
                     Span("prefill", "prefill0/draft", 0.05, 0.1, [1], 2048, 0),
                     Span("draft", "decode0/draft", 0.06, 0.07, [0], 1, 2048)])
    rows = {(r["worker"], r["stage"]): r for r in stage_audit(trace, fixed_costs())}
    job = 2 * ALONE["prefill"]  # FixedCost prices the draft's pass as the target's
    fd = f(LAW["draft"], ALONE["draft"], job)
    assert rows["draft", "draft" + BESIDE]["priced_ms"] == pytest.approx(
        ALONE["draft"] * fd * 1e3)


def test_a_kept_audit_is_stretched_by_the_rows_of_the_other_loop():
    """Without its trace, a decode-loop row runs beside the prefill loop's rows (and back),
    each in proportion to the time it ran beside."""
    rows = [{"worker": "draft", "stage": "draft" + BESIDE, "batch": 1, "tokens_per_seq": 1,
             "context": 2048, "spans": 10, "measured_ms": 10.0, "priced_ms": 1.0,
             "error_pct": -90.0, "beside": 0.5},
            {"worker": "target", "stage": "prefill" + BESIDE, "batch": 1,
             "tokens_per_seq": 2048, "context": 0, "spans": 2, "measured_ms": 60.0,
             "priced_ms": 50.0, "error_pct": -16.7, "beside": 1.0},
            {"worker": "target", "stage": "verify", "batch": 1, "tokens_per_seq": 5,
             "context": 2048, "spans": 10, "measured_ms": 5.0, "priced_ms": 5.0,
             "error_pct": 0.0, "beside": 0.0}]
    for scale in (1.0, 2.0):  # priced by the new costs, the other loop's too
        got = reprice(rows, fixed_costs(scale))
        d = scale * ALONE["draft"]
        fd = f(LAW["draft"], d, scale * ALONE["prefill"])
        assert got[0]["priced_ms"] == pytest.approx(d / (0.5 + 0.5 / fd) * 1e3)
        assert got[0]["alone_ms"] == pytest.approx(d * 1e3)
        fp = f(LAW["prefill"], scale * ALONE["prefill"], d)
        assert got[1]["priced_ms"] == pytest.approx(scale * ALONE["prefill"] * fp * 1e3)
        assert got[2]["priced_ms"] == pytest.approx(scale * ALONE["verify"] * 1e3)
        assert got[0]["measured_ms"] == rows[0]["measured_ms"]


def test_a_simulated_one_gpu_disaggregated_run_is_priced_as_it_ran():
    sc = load_scenario(ROOT / "scenarios/validation/disaggregated-light.yaml",
                       ["workload.requests=16"])
    costs = build_costs(sc, np.random.default_rng(0))
    rows = stage_audit(simulate(sc, trace="full"), costs)
    alone = [r for r in rows if BESIDE not in r["stage"]]
    beside = [r for r in rows if BESIDE in r["stage"]]
    assert alone and beside
    for r in alone:  # priced as the simulator ran them (a round's draft steps: its context)
        assert r["beside"] < BESIDE_AT and r["error_pct"] == pytest.approx(0.0, abs=1.0), r
    for r in beside:  # slowed by the contention law, beyond their price alone
        assert r["beside"] >= BESIDE_AT and r["measured_ms"] > 1.02 * r["alone_ms"], r
    for t in totals(beside):  # and charged what the simulator charged them, within its
        # jobs' grain (a round's host time weighs its verify's job, not traced)
        assert t["error_pct"] == pytest.approx(0.0, abs=10.0), t
    again = reprice(rows, costs)  # a kept audit: its beside rows priced by their base stage
    assert [r["stage"] for r in again] == [r["stage"] for r in rows]
    for t in totals([r for r in again if BESIDE in r["stage"]]):  # and the rows' law
        assert t["error_pct"] == pytest.approx(0.0, abs=25.0), t
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
