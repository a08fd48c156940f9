"""The speculative decode worker's draft steps beside a prefill chunk: overlap rows of the
draft's steps fit laws of their own (`draft`, and `prefill/draft` for a chunk beside them),
the shared device slows a draft step by the draft's law, and a profile without such rows
keeps today's law (a draft step decode-like, a round one job)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import simpy

from kestrel_sim.costs.base import Shares
from kestrel_sim.costs.build import build_costs
from kestrel_sim.costs.contention import Contention, OverlapRow, fit_contention
from kestrel_sim.costs.interleave import Ratio, fit_ratio, law_for
from kestrel_sim.costs.profile import ProfileFits
from kestrel_sim.profile import Measurement, Profile
from kestrel_sim.scenario import load_scenario
from kestrel_sim.sim.device import SharedDevice
from kestrel_sim.sim.engine import simulate
from kestrel_sim.stage_audit import BESIDE, stage_audit

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "tests" / "sim" / "data" / "qwen3-8b_h200_v1.json"  # no overlap rows
MEMORY = Shares(0.8, 0.02, 0.8, 0.02)
COMPUTE = Shares(0.1, 0.95, 0.03, 0.95)
# the H200's decode and prefill laws, about (qwen3-8b_h200.json); the draft's: a few %
LAW = {"decode": Ratio(0.55, 0.8), "prefill": Ratio(1.2, 0.8), "draft": Ratio(0.01, 0.3),
       "prefill/draft": Ratio(0.02, 0.5)}
STEPS = [("decode", 4, 1, 1024), ("decode", 32, 1, 1024), ("verify", 4, 5, 1024),
         ("verify", 32, 5, 1024)]
DRAFTS = [("draft", 4, 1, 1024), ("draft", 32, 1, 1024)]
CHUNKS = [("prefill", 1, 512, 0), ("prefill", 1, 2048, 0)]


def side(stage: str) -> str:
    return stage if stage in ("prefill", "draft") else "decode"


def rows_of(steps: dict[str, list[float]]) -> list[OverlapRow]:
    """Both ways round, every step of `steps` (stage -> times alone) beside chunks of 16
    and 56 ms, slowed by LAW."""
    out = []
    for stage, times in steps.items():
        for own in times:
            for chunk in (16.0, 56.0):
                for mine, other, t, o in ((side(stage), "prefill", own, chunk),
                                          ("prefill", side(stage), chunk, own)):
                    law = law_for(LAW, mine, other)
                    out.append(OverlapRow(MEMORY, COMPUTE, mine, 1.0 + law.excess(t, o), t, o,
                                          other))
    return out


def test_rows_of_decode_verify_and_draft_fit_laws_of_their_own():
    rows = rows_of({"decode": [5.0, 12.0], "verify": [10.0, 40.0], "draft": [0.9, 1.3]})
    fitted = fit_contention(rows)
    assert fitted.law == "interleave" and fitted.drafts_apart
    assert set(fitted.ratio) == set(LAW)
    for key, law in LAW.items():
        assert fitted.ratio[key].a == pytest.approx(law.a, rel=1e-6), key
        assert fitted.ratio[key].b == pytest.approx(law.b, rel=1e-6), key
    # held out per side: every law's rows, each predicted by a law fitted without it
    assert {k: len(v) for k, v in fitted.held_out_by.items()} == {
        "decode": 8, "prefill": 8, "draft": 4, "prefill/draft": 4}
    assert max(fitted.held_out_pct) < 1e-6
    assert "draft 0.01 x (T_other / T)^0.30" in fitted.describe()


def test_without_draft_rows_the_fit_is_todays():
    rows = rows_of({"decode": [5.0, 12.0], "verify": [10.0, 40.0]})
    fitted = fit_contention(rows)
    assert set(fitted.ratio) == {"decode", "prefill"} and not fitted.drafts_apart
    # today's fit: each side on its own rows, held out on the side's other rows
    for s in ("decode", "prefill"):
        today = fit_ratio([r.pair() for r in rows if r.side == s])
        assert fitted.ratio[s] == today
    held = []
    for i, r in enumerate(rows):
        law = fit_ratio([q.pair() for j, q in enumerate(rows) if j != i and q.side == r.side])
        held.append(abs((1 + law.excess(r.timed_ms, r.other_ms)) / r.observed - 1) * 100)
    assert fitted.held_out_pct == held
    # a draft step takes the decode side's law
    assert law_for(fitted.ratio, "draft", "prefill") == fitted.ratio["decode"]
    assert law_for(fitted.ratio, "prefill", "draft") == fitted.ratio["prefill"]


def test_the_device_slows_a_draft_job_by_the_draft_law_weighed_as_one_step():
    laws = {k: LAW[k] for k in LAW}
    env = simpy.Environment()
    device = SharedDevice(env, Contention(rows=1, law="interleave", ratio=laws))
    chunk = device.run(0.056, COMPUTE, "prefill")
    drafts = device.run(0.004, MEMORY, "draft", grain=0.001)  # 4 draft steps of 1 ms
    assert drafts.factor == pytest.approx(1 + LAW["draft"].excess(0.001, 0.056))
    assert chunk.factor == pytest.approx(1 + LAW["prefill/draft"].excess(0.056, 0.001))
    env.run()
    assert drafts.marks[-1][2] == drafts.factor
    # a decode-like job takes the decode law, and the chunk beside it the prefill law
    env = simpy.Environment()
    device = SharedDevice(env, Contention(rows=1, law="interleave", ratio=laws))
    chunk = device.run(0.056, COMPUTE, "prefill")
    verify = device.run(0.010, MEMORY, "decode")
    assert verify.factor == pytest.approx(1 + LAW["decode"].excess(0.010, 0.056))
    assert chunk.factor == pytest.approx(1 + LAW["prefill"].excess(0.056, 0.010))


def overlap_row(timed, other, ms: float, alone_ms: float) -> Measurement:
    return Measurement(stage="overlap", step_stage=timed[0], batch=timed[1],
                       tokens_per_seq=timed[2], context=timed[3], other_stage=other[0],
                       other_batch=other[1], other_tokens_per_seq=other[2],
                       other_context=other[3], ms=ms, alone_ms=alone_ms)


def profile_with(draft_rows: bool) -> Profile:
    """The bundled profile plus overlap rows slowed by LAW: decode and verify steps beside
    chunks both ways round, and (draft_rows) the draft's steps too."""
    base = Profile.load(BUNDLED)
    fits = ProfileFits(base)
    rows = []
    for step in STEPS + (DRAFTS if draft_rows else []):
        for chunk in CHUNKS:
            for timed, other in ((step, chunk), (chunk, step)):
                t, o = fits.step_ms(*timed), fits.step_ms(*other)
                f = 1 + law_for(LAW, side(timed[0]), side(other[0])).excess(t, o)
                rows.append(overlap_row(timed, other, t * f, t))
    return Profile(fingerprint=base.fingerprint, measurements=[*base.measurements, *rows])


def beside_error(path: Path, stage: str) -> float:
    """The simulated time of `stage`'s steps beside the other loop against their price
    alone (stage_audit's alone_ms), % off (disaggregated-light on one GPU, with the profile
    at `path`)."""
    sc = load_scenario(ROOT / "scenarios/validation/disaggregated-light.yaml",
                       ["workload.requests=16", f"costs.profile={path}"])
    rows = stage_audit(simulate(sc, trace="full"), build_costs(sc, np.random.default_rng(0)))
    mine = [r for r in rows if BESIDE in r["stage"] and r["stage"].startswith(stage)]
    assert mine
    return float(np.median([(r["alone_ms"] / r["measured_ms"] - 1) * 100 for r in mine]))


def test_the_simulator_slows_draft_steps_by_the_draft_law(tmp_path):
    slowed = {}
    for draft_rows in (False, True):
        path = tmp_path / f"draft-{draft_rows}.json"
        profile = profile_with(draft_rows)
        profile.save(path)
        contention = ProfileFits(profile).contention()
        assert contention.drafts_apart == draft_rows
        slowed[draft_rows] = beside_error(path, "draft")
    # the decode side's law slows a round's draft steps with its verify (today); the
    # draft's own law (LAW: a few %) barely slows them
    assert slowed[False] < -20.0
    assert -10.0 < slowed[True] < 0.0
