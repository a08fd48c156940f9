"""The profile cost model's fit: context slopes only from context the data vary, never
negative, borrowed from decode for stages measured at one context; beyond the measured
tokens the roofline term turns compute-bound. Checked on roofline-made data and on the
bundled H200 profile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.profile import STEP_STAGES, Profile

BUNDLED = Path(__file__).resolve().parents[2] / "calibration" / "profiles" / "qwen3-8b_h200.json"
H200 = load_hardware("h200")


def profile_of(rows) -> Profile:
    return Profile.model_validate({
        "fingerprint": {"device": "NVIDIA H200", "model": "qwen3-8b"},
        "measurements": [{"stage": s, "batch": b, "tokens_per_seq": m, "context": c, "ms": ms}
                         for s, b, m, c, ms in rows],
    })


def roofline_rows(cost, stage, batches, ms_, contexts):
    return [(stage, b, m, c, cost.seconds(stage, b, m, c) * 1e3)
            for b in batches for m in ms_ for c in contexts]


def grid_like_the_bundled_profile() -> ProfileCost:
    """decode over b at two contexts, verify over b and M at ONE context, prefill at c = 0."""
    roof = RooflineCost(H200, preset("qwen3-8b"))
    rows = (roofline_rows(roof, "decode", [1, 2, 4, 8, 16, 32, 64], [1], [128, 2016])
            + roofline_rows(roof, "verify", [1, 4, 16], range(2, 10), [128])
            + roofline_rows(roof, "prefill", [1], [512, 2048, 8192], [0]))
    return ProfileCost(profile_of(rows))


def test_verify_measured_at_one_context_borrows_decodes_kv_slope():
    fit = grid_like_the_bundled_profile()
    roof = RooflineCost(H200, preset("qwen3-8b"))
    for b, c in [(4, 2000), (16, 4000), (16, 8000)]:
        measured_like = roof.seconds("verify", b, 5, c)
        assert fit.seconds("verify", b, 5, c) == pytest.approx(measured_like, rel=0.05)
    # more context never makes a step faster
    times = [fit.seconds("verify", 16, 5, c) for c in (128, 1000, 4000, 16000)]
    assert times == sorted(times) and times[-1] > times[0]


def test_above_the_measured_tokens_the_roofline_turns_compute_bound():
    fit = grid_like_the_bundled_profile()
    roof = RooflineCost(H200, preset("qwen3-8b"))
    # verify was measured up to T = 16 x 9 = 144, all memory-bound; past T ~ 200 the math
    # outgrows the weight read, which the max of the two terms follows
    for b in (32, 64, 128):
        assert fit.seconds("verify", b, 8, 0) == pytest.approx(roof.seconds("verify", b, 8, 0),
                                                               rel=1e-6)
    t = [fit.seconds("verify", b, 5, 128) for b in (16, 32, 64, 128)]
    assert t == sorted(t)


def test_noisy_measurements_never_give_a_negative_context_slope():
    rng = np.random.default_rng(0)
    rows = []
    for b in (1, 2, 4, 8, 16):
        for m in (2, 4, 8):
            # cost falls with batch at fixed T (a kernel effect), context fixed at 128
            rows.append(("verify", b, m, 128, 5.0 + 0.05 * b * m - 0.02 * b + rng.normal(0, 0.01)))
    for b in (1, 4, 16):
        for c in (128, 1024):
            rows.append(("decode", b, 1, c, 4.0 + 0.01 * b + 1e-4 * b * c))
    fit = ProfileCost(profile_of(rows))
    short, long = fit.seconds("verify", 16, 4, 128), fit.seconds("verify", 16, 4, 8000)
    assert long > short  # decode's positive KV slope, not the batch effect read as context
    assert long - short == pytest.approx(1e-4 * 16 * (8000 - 128) * 1e-3, rel=0.02)


@pytest.mark.skipif(not BUNDLED.is_file(), reason="bundled profile not present")
def test_bundled_profile_fit_reproduces_its_measurements():
    profile = Profile.load(BUNDLED)
    fit, physical = ProfileCost(profile), ProfileCost(profile, correction=False)
    errors = []
    for mm in profile.measurements:
        if mm.stage not in STEP_STAGES or mm.device == "cpu":  # priced elsewhere: mixed,
            continue  # the link's and overlap rows, the draft on the CPU
        # with the correction, each measured point exactly; the terms alone, roughly
        got = fit.seconds(mm.stage, mm.batch, mm.tokens_per_seq, mm.context) * 1e3
        if mm.stage == "prefill" and mm.batch > 1 and profile.runtime.per_chunk:
            # b chunks priced as b forwards of one (RuntimeInfo.chunks): b x the batch-1
            # row; measured so, b chunks take 1-4% more than that on the H200, and up to 10%
            # where the batch-1 row was timed on a cooler GPU (2 x 512 tokens at context 0
            # in the profile of 271d5cf: back-to-back repeats lower the clock, by 6% for a
            # 2048-token prefill in bench/probes/clock_probe.py)
            one = fit.seconds("prefill", 1, mm.tokens_per_seq, mm.context) * 1e3
            assert got == pytest.approx(mm.batch * one, rel=1e-9), mm
            assert got == pytest.approx(mm.ms, rel=0.11), mm
        else:
            assert got == pytest.approx(mm.ms, rel=1e-9), mm
        alone = physical.seconds(mm.stage, mm.batch, mm.tokens_per_seq, mm.context) * 1e3
        errors.append(abs(alone / mm.ms - 1))
    # the terms alone are off by up to 81% where a kernel changes (verify at M = 9 and at
    # batch >= 32, M = 2, on the H200): the correction's job; typically within 8%
    assert np.median(errors) < 0.08
    for b in (1, 16, 64):  # physical: verify of k+1 tokens costs at least a decode step,
        for c in (128, 2016, 4000):  # and both grow with context
            assert fit.seconds("verify", b, 5, c) >= fit.seconds("decode", b, 1, c)
        assert fit.seconds("verify", b, 5, 4000) > fit.seconds("verify", b, 5, 128)
