"""A quantized draft's rows fitted with its weights as measured (Fingerprint.draft_quant):
the draft's StepWork reads int8 / int4 / int4-last-N bytes per parameter, as the target's
reads its quant, and a roofline calibrated from them prices the draft with those bytes."""

from __future__ import annotations

import pytest

from kestrel_sim.costs.calibrated import CalibratedRoofline
from kestrel_sim.costs.profile import ProfileCost, ProfileFits
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.work import StepWork
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.profile import Profile

H200, H100 = load_hardware("h200"), load_hardware("h100")
DRAFT = preset("qwen3-0.6b")
POINTS = [(b, c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (256, 1024, 4096)]


def rows(cost: RooflineCost, stage: str, name: str) -> list[dict]:
    return [{"stage": name, "batch": b, "tokens_per_seq": 1, "context": c,
             "ms": cost.seconds(stage, b, 1, c) * 1e3} for b, c in POINTS]


def profile(measured: str, recorded: str | None) -> Profile:
    """qwen3-8b (bf16) and a qwen3-0.6b draft whose weights were `measured`, timed by the
    H200 roofline; the fingerprint records draft_quant `recorded` (None: no key)."""
    target = RooflineCost(H200, preset("qwen3-8b"))
    draft = RooflineCost(H200, DRAFT, quant=measured)
    fp = {"device": "NVIDIA H200", "model": "qwen3-8b", "draft_model": "qwen3-0.6b"}
    if recorded is not None:
        fp["draft_quant"] = recorded
    return Profile.model_validate({"fingerprint": fp, "measurements": rows(
        target, "decode", "decode") + rows(draft, "decode", "draft")})


def test_an_int8_drafts_work_reads_half_the_weight_bytes_of_bf16():
    bf16 = ProfileFits(profile("none", None)).works["draft"]
    int8 = ProfileFits(profile("int8", "int8")).works["draft"]
    assert bf16.w_fixed == StepWork(DRAFT, 2.0).w_fixed  # default none: unchanged
    assert int8.weight_bytes(1) == pytest.approx(0.5 * bf16.weight_bytes(1))
    mixed = ProfileFits(profile("int4-last-14", "int4-last-14")).works["draft"]
    layers = DRAFT.num_hidden_layers
    per_param = (14 * 0.5 + (layers - 14) * 1.0) / layers
    assert mixed.w_fixed == pytest.approx(per_param / 2.0 * bf16.w_fixed)
    # the target's weights are its own quant's, whatever the draft's
    target = ProfileFits(profile("int8", "int8")).works["target"]
    assert target.w_fixed == StepWork(preset("qwen3-8b"), 2.0).w_fixed


@pytest.mark.parametrize("quant", ["int8", "int4", "int4-last-14"])
def test_the_drafts_terms_are_fitted_with_its_measured_weights(quant):
    truth = RooflineCost(H200, DRAFT, quant=quant)
    fitted = ProfileFits(profile(quant, quant), correction=False).models["draft", "gpu"]
    # decode's weight read is the same at every batch: the fit puts it in the weights term
    # at the stated bandwidth, so the overhead left is the roofline's fixed time, the one
    # an unquantized draft's rows leave
    bf16 = ProfileFits(profile("none", "none"), correction=False).models["draft", "gpu"]
    assert fitted.terms.overhead == pytest.approx(bf16.terms.overhead, rel=1e-6)
    # read as bf16 weights, the same rows leave a smaller overhead: the weights twice
    as_bf16 = ProfileFits(profile(quant, "none"), correction=False).models["draft", "gpu"]
    assert as_bf16.terms.overhead < 0.8 * fitted.terms.overhead
    cost = ProfileCost(profile(quant, quant), stages=("draft",), correction=False)
    for b, c in ((3, 700), (24, 2048)):
        assert cost.seconds("draft", b, 1, c) == pytest.approx(
            truth.seconds("draft", b, 1, c), rel=1e-6)


@pytest.mark.parametrize("quant", ["int8", "int4-last-14"])
def test_a_calibrated_roofline_moves_a_quantized_draft_with_its_bytes(quant):
    fits = ProfileFits(profile(quant, quant), correction=False)
    on_h100 = CalibratedRoofline(fits, H200, H100, DRAFT, "p", role="draft")
    truth = RooflineCost(H100, DRAFT, quant=quant)
    for b, c in ((1, 256), (8, 4096), (64, 1024)):
        assert on_h100.seconds("draft", b, 1, c) == pytest.approx(
            truth.seconds("draft", b, 1, c), rel=1e-6)
    # a draft the profile did not measure: the target's decode over unquantized weights
    other = CalibratedRoofline(fits, H200, H100, preset("qwen3-1.7b"), "p", role="draft")
    assert other.model("draft").work.w_fixed == StepWork(preset("qwen3-1.7b"), 2.0).w_fixed
