"""The contention of steps sharing a device, fitted from a profile's overlap rows: the rows'
schema, the fit recovering a known lam per side, and the fitted lam reaching the simulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.build import build_costs, describe_costs
from kestrel_sim.costs.contention import (
    DEFAULT_SERIAL,
    OverlapRow,
    fit_contention,
    predict,
    side_of,
)
from kestrel_sim.costs.profile import ProfileFits
from kestrel_sim.profile import Measurement, Profile
from kestrel_sim.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]
# a profile without overlap rows (the hand-made one of 2026-12-01, schema version 1): the
# tests add their own, made by the model at a known lam
BUNDLED = ROOT / "tests" / "sim" / "data" / "qwen3-8b_h200_v1.json"
# (timed stage, batch, M, context) x (other stage, batch, M, context): what the default
# grid's overlap section measures, both ways round
STEPS = [("decode", 4, 1, 1024), ("decode", 32, 1, 1024), ("verify", 4, 5, 1024),
         ("verify", 32, 5, 1024)]
CHUNKS = [("prefill", 1, 512, 0), ("prefill", 1, 2048, 0)]


def overlap_row(timed, other, ms: float, alone_ms: float) -> Measurement:
    return Measurement(stage="overlap", step_stage=timed[0], batch=timed[1],
                       tokens_per_seq=timed[2], context=timed[3], other_stage=other[0],
                       other_batch=other[1], other_tokens_per_seq=other[2],
                       other_context=other[3], ms=ms, alone_ms=alone_ms)


def with_overlaps(lam: dict[str, float], noise: float = 0.0, seed: int = 0) -> Profile:
    """The bundled profile plus overlap rows made by the model at `lam` (times a lognormal
    noise of sigma `noise`)."""
    base = Profile.load(BUNDLED)
    fits = ProfileFits(base)
    rng = np.random.default_rng(seed)
    rows = []
    for step in STEPS:
        for chunk in CHUNKS:
            for timed, other in ((step, chunk), (chunk, step)):
                alone = fits.models[timed[0], "gpu"].ms(*timed[1:])
                row = OverlapRow(fits.step_shares(*timed), fits.step_shares(*other),
                                 side_of(timed[0]), 1.0)
                f = predict(row, lam[row.side]) * float(np.exp(rng.normal(0.0, noise)))
                rows.append(overlap_row(timed, other, alone * f, alone))
    return Profile(fingerprint=base.fingerprint, measurements=[*base.measurements, *rows])


def scenario(profile_path: Path, devices: list[str]) -> Scenario:
    return Scenario.load_from_dict({
        "name": "fit", "hardware": "h200", "model": "qwen3-8b",
        "serving": {"mode": "disaggregated", "max_batch": 64, "prefill_chunk": 2048,
                    "link": "nvlink", "devices": devices},
        "workload": {"arrivals": {"process": "poisson", "rate": 8.0}, "requests": 80,
                     "prompt_tokens": {"dist": "uniform", "low": 1000, "high": 3000},
                     "output_tokens": {"dist": "uniform", "low": 64, "high": 192}, "seed": 1},
        "costs": {"profile": str(profile_path)},
    })


# ---------------------------------------------------------------- the rows


def test_an_overlap_row_reads_as_its_two_steps_and_round_trips(tmp_path):
    row = overlap_row(("decode", 32, 1, 1024), ("prefill", 1, 2048, 0), 9.0, 6.0)
    assert row.slowdown == 1.5
    profile = with_overlaps({"decode": 0.3, "prefill": 0.1})
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.rows("overlap") == profile.rows("overlap")
    assert len(again.rows("overlap")) == 2 * len(STEPS) * len(CHUNKS)


def test_overlap_fields_belong_to_overlap_rows_only():
    with pytest.raises(ValueError, match="an overlap row needs other_batch"):
        Measurement(stage="overlap", step_stage="decode", batch=1, tokens_per_seq=1,
                    other_stage="prefill", other_tokens_per_seq=512, ms=2.0, alone_ms=1.0)
    with pytest.raises(ValueError, match="only apply to stage overlap"):
        Measurement(stage="decode", batch=1, tokens_per_seq=1, ms=2.0, alone_ms=1.0)


def test_a_profile_without_overlap_rows_loads_and_takes_the_default():
    fits = ProfileFits(Profile.load(BUNDLED))
    contention = fits.contention()
    assert not contention.fitted and contention.serial == {"decode": DEFAULT_SERIAL,
                                                           "prefill": DEFAULT_SERIAL}


# ---------------------------------------------------------------- the fit


def test_the_fit_recovers_lam_per_side_from_synthetic_rows():
    truth = {"decode": 0.42, "prefill": 0.17}
    fitted = ProfileFits(with_overlaps(truth)).contention()
    assert fitted.rows == 2 * len(STEPS) * len(CHUNKS)
    assert fitted.serial == pytest.approx(truth, abs=1e-9)
    assert max(fitted.held_out_pct) < 1e-6


def test_the_fit_recovers_lam_from_noisy_rows():
    truth = {"decode": 0.6, "prefill": 0.25}
    fitted = ProfileFits(with_overlaps(truth, noise=0.02, seed=5)).contention()
    assert fitted.serial["decode"] == pytest.approx(truth["decode"], abs=0.08)
    assert fitted.serial["prefill"] == pytest.approx(truth["prefill"], abs=0.08)
    assert np.median(fitted.held_out_pct) < 5


def test_a_side_without_rows_takes_the_fit_of_all_rows():
    rows = ProfileFits(with_overlaps({"decode": 0.3, "prefill": 0.3})).overlap_rows()
    decode_only = fit_contention([r for r in rows if r.side == "decode"])
    assert decode_only.serial["prefill"] == pytest.approx(0.3)
    assert decode_only.how["prefill"].startswith("fitted on all rows")


def test_lam_is_kept_between_its_bounds():
    rows = ProfileFits(with_overlaps({"decode": 1.0, "prefill": 1.0})).overlap_rows()
    for r in rows:
        r.observed *= 1.5  # slower than kernels one at a time
    assert fit_contention(rows).serial == {"decode": 1.0, "prefill": 1.0}
    for r in rows:
        r.observed = 1.0  # no slowdown at all: faster than ideal sharing
    assert fit_contention(rows).serial == pytest.approx({"decode": 0.0, "prefill": 0.0})


# ---------------------------------------------------------------- into the simulator


def test_the_fitted_lam_prices_a_shared_device(tmp_path):
    tpot = {}
    for lam in (0.1, 0.9):
        path = tmp_path / f"lam{lam}.json"
        with_overlaps({"decode": lam, "prefill": lam}).save(path)
        costs = build_costs(scenario(path, ["cuda:0"]), np.random.default_rng(0))
        assert costs.contention.serial["decode"] == pytest.approx(lam)
        assert f"lam decode {lam:.2f}, prefill {lam:.2f} fitted from 16 overlap rows" in (
            describe_costs(costs))
        tpot[lam] = simulate(scenario(path, ["cuda:0"])).metrics.median_tpot_ms
        apart = simulate(scenario(path, ["cuda:0", "cuda:1"])).metrics.median_tpot_ms
        assert tpot[lam] > apart
    assert tpot[0.9] > tpot[0.1]


def test_a_profile_with_overlap_rows_still_fits_its_stages_as_before():
    plain = ProfileFits(Profile.load(BUNDLED))
    more = ProfileFits(with_overlaps({"decode": 0.5, "prefill": 0.5}))
    assert set(more.models) == set(plain.models)
    for key, model in plain.models.items():
        assert more.models[key].terms == model.terms
    with pytest.raises(ValueError, match="an overlap row needs"):
        Profile.model_validate({"fingerprint": {"device": "x", "model": "qwen3-8b"},
                                "measurements": [{"stage": "overlap", "batch": 1,
                                                  "tokens_per_seq": 1, "ms": 1.0}]})


def test_the_fit_report_gives_the_contention_and_its_held_out_error():
    from kestrel_sim.costs.report import fit_report

    report = fit_report(with_overlaps({"decode": 0.4, "prefill": 0.2}), "p.json")
    assert report.overlap["serial"] == pytest.approx({"decode": 0.4, "prefill": 0.2})
    assert report.overlap["rows"] == 16 and report.overlap["max_pct"] < 1e-6
    assert report.overlap["law"] == "shares"  # rows made by it: it predicts them exactly
    assert "overlap: shares, lam decode 0.40, prefill 0.20 from 16 rows" in report.table()
    assert fit_report(Profile.load(BUNDLED)).overlap is None
