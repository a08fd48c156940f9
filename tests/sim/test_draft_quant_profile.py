"""A profile's draft quant (Fingerprint.draft_quant, `kestrel calibrate --draft-quant`): its
draft rows price a scenario's draft of that quant, and are refused for a draft of other
weights, as the target's quant is; files without the key read as unquantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.build import build_costs
from kestrel_sim.costs.calibrated import CalibratedRoofline
from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.errors import ConfigError
from kestrel_sim.profile import Fingerprint, Profile
from kestrel_sim.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "calibration" / "profiles" / "qwen3-8b_h200.json"  # draft qwen3-0.6b rows
ORGANIC = ROOT / "scenarios" / "validation" / "spec-organic-int4-copy.yaml"


def with_draft_quant(tmp_path, quant: str) -> Path:
    """The bundled profile as if its draft had been measured quantized as `quant`."""
    profile = Profile.load(BUNDLED)
    fp = Fingerprint.model_validate(profile.fingerprint.model_dump() | {"draft_quant": quant})
    path = tmp_path / f"draft-{quant}.json"
    profile.model_copy(update={"fingerprint": fp}).save(path)
    return path


def scenario(costs: dict, draft: dict) -> Scenario:
    return Scenario.load_from_dict({
        "hardware": "h200", "model": "qwen3-8b", "costs": costs, "draft": draft,
        "spec": {"k": 4, "acceptance": {"alpha": 0.6}},
        "workload": {"arrivals": {"process": "poisson", "rate": 4.0}, "requests": 20}})


def costs_of(sc: Scenario):
    return build_costs(sc, np.random.default_rng(0))


def test_a_file_without_the_key_measured_an_unquantized_draft(tmp_path):
    assert Profile.load(BUNDLED).fingerprint.draft_quant == "none"
    path = with_draft_quant(tmp_path, "int4-last-14")
    assert Profile.load(path).fingerprint.draft_quant == "int4-last-14"  # saved and read
    with pytest.raises(ValueError, match="'int3' is not a quantization"):
        Fingerprint(device="NVIDIA H200", model="qwen3-8b", draft_quant="int3")


@pytest.mark.parametrize("device", ["gpu", "cpu"], ids=["draft-on-the-gpu", "draft-on-the-cpu"])
def test_the_drafts_rows_price_a_draft_of_their_quant(tmp_path, device):
    path = with_draft_quant(tmp_path, "int8")
    sc = scenario({"profile": str(path)},
                  {"model": "qwen3-0.6b", "quant": "int8", "device": device})
    costs = costs_of(sc)
    assert costs.source == "profile"
    assert isinstance(costs.draft, ProfileCost)  # its own draft rows, on that device
    run = simulate(sc)
    assert all(r.finish for r in run.requests)


def test_a_profile_of_another_draft_quant_is_refused(tmp_path):
    path = with_draft_quant(tmp_path, "int8")
    unquantized = {"model": "qwen3-0.6b", "device": "gpu"}
    with pytest.raises(ConfigError, match=r"measured its draft qwen3-0.6b with quant 'int8' "
                       r"but the scenario's draft.quant is 'none'.*--draft-quant none"):
        costs_of(scenario({"profile": str(path)}, unquantized))
    organic = {"model": "qwen3-0.6b", "quant": "int4-last-14", "device": "gpu"}
    with pytest.raises(ConfigError, match="quant 'none' but the scenario's draft.quant is "
                       "'int4-last-14'"):
        costs_of(scenario({"profile": str(BUNDLED)}, organic))
    # a roofline calibrated from it prices a GPU draft by those rows too
    with pytest.raises(ConfigError, match="quant 'none' but the scenario's draft.quant"):
        costs_of(scenario({"roofline": {"calibrated_from": str(BUNDLED)}}, organic))


def test_rows_that_do_not_price_the_draft_are_not_checked(tmp_path):
    # another draft model: the profile's draft rows are not used, whatever their weights
    other = costs_of(scenario({"profile": str(BUNDLED)},
                              {"model": "qwen3-1.7b", "quant": "int8", "device": "gpu"}))
    assert isinstance(other.draft, CalibratedRoofline)
    # no draft rows (the older qwen3-0.6b profile): the organic draft is priced as before
    rowless = BUNDLED.parent / "qwen3-0.6b_h200.json"
    # (the acceptance still from the pair's profile: the rowless one measured none)
    organic = load_scenario(ORGANIC, [f"costs.profile={rowless}",
                                      f"spec.acceptance.from_profile={BUNDLED.parent / 'qwen3-0.6b-organic_h200.json'}"])
    assert organic.draft.quant == "int4-last-14"
    assert isinstance(costs_of(organic).draft, CalibratedRoofline)
    # the organic pair's own profile measured its int4-last-14 draft: its rows price it
    assert isinstance(costs_of(load_scenario(ORGANIC)).draft, ProfileCost)


def test_profiles_of_different_draft_quants_do_not_merge(tmp_path):
    a = Profile.load(BUNDLED)
    b = Profile.load(with_draft_quant(tmp_path, "int8"))
    with pytest.raises(ConfigError, match="draft_quant: 'none' vs 'int8'"):
        a.merge(b, allow_version_drift=True)
