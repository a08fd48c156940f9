"""The physical stage terms: recovered from profiles made with known coefficients, their
held-out error computed as documented, the measured correction, the fitted KV link."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.base import Chunk
from kestrel_sim.costs.build import build_costs, describe_costs
from kestrel_sim.costs.fit import TERMS, Terms, stated_rates
from kestrel_sim.costs.nnls import nnls
from kestrel_sim.costs.profile import ProfileCost, ProfileFits
from kestrel_sim.costs.report import fit_report, write_fit_report
from kestrel_sim.costs.stage_model import StageModel
from kestrel_sim.costs.work import StepWork
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.profile import Profile
from kestrel_sim.scenario import Scenario
from kestrel_sim.sim.kv import kv_transfer_bytes_per_token

H200 = load_hardware("h200")
STATED = stated_rates(H200)
KV = 1e3 / 0.9e12  # ms per KV byte: 0.9 TB/s
KNOWN = {  # ms, ms/byte, ms/flop: the coefficients the synthetic profiles are made with
    "decode": Terms(overhead=0.6, weights=STATED["weights"], gemm=STATED["gemm"],
                    serial=1e3 / 300e12, kv=KV),
    "verify": Terms(overhead=1.2, weights=STATED["weights"], gemm=STATED["gemm"],
                    serial=1e3 / 400e12, kv=KV),
    "prefill": Terms(overhead=5.0, weights=STATED["weights"], gemm=1e3 / 600e12, kv=KV,
                     attention=1e3 / 150e12),
    "mixed": Terms(overhead=1.5, weights=STATED["weights"], gemm=1e3 / 650e12,
                   serial=1e3 / 5000e12, kv=KV, attention=1e3 / 200e12),
}
GRID = {  # (batches, M, contexts)
    "decode": ([1, 2, 4, 8, 16, 32, 64], [1], [128, 1024, 4096]),
    "verify": ([1, 4, 16, 64], [2, 3, 5, 9], [256]),  # one context: kv comes from decode
    "prefill": ([1, 2, 4], [512, 2048], [0, 2048]),
}


def made_rows(shape="qwen3-8b", known=KNOWN, noise=0.0, seed=0) -> list[dict]:
    work = StepWork(preset(shape))
    rng = np.random.default_rng(seed)
    rows = []
    for stage, (bs, ms_, cs) in GRID.items():
        model = StageModel(stage, "gpu", work, known[stage], None, 0)
        for b in bs:
            for m in ms_:
                for c in cs:
                    ms = model.physical_ms(b, m, c) * (1 + noise * rng.standard_normal())
                    rows.append({"stage": stage, "batch": b, "tokens_per_seq": m,
                                 "context": c, "ms": ms})
    mixed = StageModel("mixed", "gpu", work, known["mixed"], None, 0)
    for b in (4, 16, 64):
        for m in (1, 5):
            for p in (256, 1024, 2048):
                for pc in (0, 2048):
                    ms = mixed.mixed_ms(b, m, 1024, Chunk(1, p, pc))
                    rows.append({"stage": "mixed", "batch": b, "tokens_per_seq": m,
                                 "context": 1024, "chunk_tokens": p, "chunk_context": pc,
                                 "ms": ms * (1 + noise * rng.standard_normal())})
    return rows


def make_profile(rows, model="qwen3-8b", device="NVIDIA H200") -> Profile:
    return Profile.model_validate({"fingerprint": {"device": device, "model": model},
                                   "measurements": rows})


def test_nnls_finds_the_constrained_optimum():
    rng = np.random.default_rng(3)
    for _ in range(200):
        a = rng.normal(size=(12, 4)) * rng.uniform(0.1, 10, size=4)
        b = rng.normal(size=12)
        x = nnls(a, b)
        grad = a.T @ (a @ x - b)
        assert (x >= 0).all()
        # KKT: zero gradient on free variables, non-negative on those held at 0
        assert np.allclose(grad[x > 1e-12], 0, atol=1e-8) and (grad[x <= 1e-12] > -1e-8).all()


@pytest.mark.parametrize("stage", ["decode", "verify", "prefill", "mixed"])
def test_known_coefficients_are_recovered(stage):
    fits = ProfileFits(make_profile(made_rows()), correction=False)
    got, want = fits.models[stage, "gpu"].terms, KNOWN[stage]
    for t in TERMS:
        assert getattr(got, t) == pytest.approx(getattr(want, t), rel=1e-6, abs=1e-9), t
    if stage == "verify":  # measured at one context: its KV rate is decode's
        assert got.how["kv"] == "borrowed"


def test_noisy_coefficients_are_recovered_within_the_noise():
    fits = ProfileFits(make_profile(made_rows(noise=0.01)), correction=False)
    decode, prefill = fits.models["decode", "gpu"].terms, fits.models["prefill", "gpu"].terms
    assert decode.kv == pytest.approx(KV, rel=0.05)
    assert decode.serial == pytest.approx(KNOWN["decode"].serial, rel=0.15)
    assert decode.overhead == pytest.approx(0.6, abs=0.1)
    assert prefill.attention == pytest.approx(KNOWN["prefill"].attention, rel=0.1)
    report = fit_report(make_profile(made_rows(noise=0.01)))
    for s in report.stages:
        if s.physical_median_pct is not None:
            assert s.physical_median_pct < 2.5, s  # about the 1% noise, not the model


def test_moe_weights_are_fitted_from_the_experts_a_step_touches():
    slow = {**KNOWN, "decode": Terms(overhead=0.5, weights=STATED["weights"] / 0.7,
                                     gemm=STATED["gemm"], serial=1e3 / 200e12, kv=KV)}
    rows = [r for r in made_rows("qwen3-30b-a3b", slow) if r["stage"] == "decode"]
    decode = ProfileFits(make_profile(rows, "qwen3-30b-a3b"), correction=False).models[
        "decode", "gpu"].terms
    assert decode.how["weights"] == "fitted"
    assert decode.weights == pytest.approx(STATED["weights"] / 0.7, rel=1e-6)  # 70% of 4.2 TB/s


def test_dense_weights_are_read_at_the_stated_bandwidth():
    decode = ProfileFits(make_profile(made_rows()), correction=False).models["decode", "gpu"]
    assert decode.terms.weights == STATED["weights"]
    assert decode.terms.how["weights"] == "at the stated rate"


def test_held_out_error_is_the_error_of_a_fit_that_did_not_see_the_point():
    rows = [r for r in made_rows() if r["stage"] == "decode"]
    rows[4]["ms"] *= 1.10  # one measurement 10% off the truth the others follow exactly
    report = fit_report(make_profile(rows))
    decode = next(s for s in report.stages if s.stage == "decode")
    assert decode.held_out == len(rows) == 21
    # held out, row 4 is predicted by an exact fit of the others: 1/1.1 - 1 off
    assert decode.physical_max_pct == pytest.approx(100 * (1 - 1 / 1.1), rel=1e-6)
    every = fit_report(make_profile(rows), every=5)  # holds out rows 4, 9, 14, 19
    decode = next(s for s in every.stages if s.stage == "decode")
    assert decode.held_out == 4 and every.method == "every 5th row"
    assert decode.physical_max_pct == pytest.approx(100 * (1 - 1 / 1.1), rel=1e-6)
    assert decode.physical_median_pct == pytest.approx(0, abs=1e-6)


def test_the_correction_returns_measured_points_and_stays_near_the_terms():
    rows = made_rows(noise=0.03, seed=1)
    profile = make_profile(rows)
    fit, physical = ProfileCost(profile), ProfileCost(profile, correction=False)
    for mm in profile.measurements:
        if mm.stage != "mixed":
            got = fit.seconds(mm.stage, mm.batch, mm.tokens_per_seq, mm.context) * 1e3
            assert got == pytest.approx(mm.ms, rel=1e-9)
    # between measured points the correction is a blend of the neighbours' residuals
    for b, c in [(6, 700), (48, 3000)]:
        assert fit.seconds("decode", b, 1, c) == pytest.approx(
            physical.seconds("decode", b, 1, c), rel=0.1)


def test_mixed_rows_are_fitted_and_the_marginal_rule_is_reported(tmp_path):
    profile = make_profile(made_rows())
    cost = ProfileCost(profile, correction=False)
    assert cost.mixed_source == "fitted from 36 mixed measurements"
    truth = StageModel("mixed", "gpu", StepWork(preset("qwen3-8b")), KNOWN["mixed"], None, 0)
    chunk = Chunk(2, 300, 500)
    assert cost.mixed_seconds("verify", 24, 5, 1500, chunk) == pytest.approx(
        truth.mixed_ms(24, 5, 1500, chunk) * 1e-3, rel=1e-6)
    without = ProfileCost(make_profile([r for r in made_rows() if r["stage"] != "mixed"]))
    assert without.mixed_source.startswith("step + marginal chunk")
    path = tmp_path / "p.json"
    profile.save(path)
    report = write_fit_report(profile, path)
    assert any(s.stage == "mixed (marginal rule)" for s in report.stages)
    text = (tmp_path / "p.fit.txt").read_text()
    assert "leave-one-out" in text and "mixed (marginal rule)" in text
    assert (tmp_path / "p.fit.json").is_file()


def transfer_rows(latency_us=20.0, gb_s=50.0) -> list[dict]:
    per_token = 2 * preset("qwen3-8b").kv_elements_per_token
    return [{"stage": "kv_transfer", "batch": 1, "tokens_per_seq": n, "bytes": n * per_token,
             "ms": latency_us * 1e-3 + n * per_token / (gb_s * 1e9) * 1e3}
            for n in (256, 1024, 4096, 16384)]


def test_kv_transfer_rows_fit_the_link_a_disaggregated_run_uses(tmp_path):
    rows = [r for r in made_rows() if r["stage"] in ("prefill", "decode")] + transfer_rows()
    make_profile(rows).save(tmp_path / "p.json")
    link = ProfileFits(Profile.load(tmp_path / "p.json")).link()
    assert link.bandwidth_gb_s == pytest.approx(50.0) and link.latency_us == pytest.approx(20.0)
    sc = Scenario.load_from_dict({
        "hardware": "p.json", "serving": {"mode": "disaggregated"},
        "workload": {"arrivals": {"process": "poisson", "rate": 2.0}, "requests": 20},
    }, base_dir=tmp_path)
    costs = build_costs(sc, np.random.default_rng(0))
    assert "KV link fitted: 50 GB/s, 20 us" in describe_costs(costs)
    per_token = kv_transfer_bytes_per_token(sc, costs.hardware)
    spans = [s for s in simulate(sc, trace="full").spans if s.kind == "kv_transfer"]
    assert len(spans) == 20
    for s in spans:
        assert s.end - s.start == pytest.approx(link.seconds(s.tokens * per_token), rel=1e-9)
    named = Scenario.load_from_dict({**sc.model_dump(mode="json"),
                                     "serving": {"mode": "disaggregated", "link": "pcie5"}})
    assert build_costs(named, np.random.default_rng(0)).link is None  # the scenario's own


def test_a_profile_measured_on_the_cpu_is_priced_from_its_cpu_rows():
    rows = [{**r, "device": "cpu"} for r in made_rows() if r["stage"] in ("decode", "prefill")]
    cost = ProfileCost(make_profile(rows, device="Intel(R) Xeon(R) Platinum 8480+"))
    assert cost.device == "cpu" and cost.has("decode")
    decode = cost.fits.models["decode", "cpu"]
    assert decode.terms.how["weights"] == "in overhead (device unknown)"
    for r in rows[:5]:
        assert cost.seconds("decode", r["batch"], 1, r["context"]) * 1e3 == pytest.approx(r["ms"])


def test_the_report_prints_and_writes_from_the_command_line(tmp_path, capsys):
    from kestrel_sim.costs.report import main

    make_profile(made_rows()).save(tmp_path / "p.json")
    assert main([str(tmp_path / "p.json"), "--every", "3", "--write"]) == 0
    out = capsys.readouterr().out
    assert "held out: every 3rd row" in out and "decode" in out and "* the device's" in out
    assert (tmp_path / "p.fit.txt").read_text().strip() == out.strip()
    assert main([str(tmp_path / "nope.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().out
