"""Acceptance measured on the device: a Profile's optional `acceptance` block (schema-checked,
saved and read back, merged) and a scenario's `spec.acceptance: {from_profile: ...}`, which
takes exactly the block's rates for positions 1..k, and refuses what does not fit, naming
the key, the profile and the command that measures it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.acceptance import build_acceptance, describe_acceptance, pmf_from_rates
from kestrel_sim.errors import ConfigError
from kestrel_sim.measured_acceptance import MeasuredAcceptance
from kestrel_sim.metrics import compute_metrics
from kestrel_sim.profile import Profile
from kestrel_sim.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[2]
ORGANIC_PROFILE = ROOT / "calibration" / "profiles" / "qwen3-0.6b-organic_h200.json"
# measured before profiles held an acceptance block (kept for the runs of that runtime)
OLDER_PROFILE = (ROOT / "calibration" / "profiles" / "archive"
                 / "qwen3-0.6b-organic_h200_8fbd978.json")
PAIR = {"draft_model": "qwen3-0.6b", "draft_quant": "int4-last-14", "device": "NVIDIA H200",
        "draft_device": "gpu", "dtype": "bfloat16", "backend": "cupy+graphs",
        "prompts": 4, "prompt_tokens": 512, "rounds": 5}
# 20 drafts at k = 6: how many of its 6 proposals each kept
LENGTHS = [0, 1, 2, 6, 6, 3, 1, 0, 4, 5, 6, 2, 2, 1, 0, 6, 3, 4, 1, 2]


def block(lengths=LENGTHS, k: int = 6, **changes) -> MeasuredAcceptance:
    return MeasuredAcceptance.from_lengths(lengths, k, **(PAIR | changes))


def profile_with(tmp_path, acceptance: MeasuredAcceptance | None, name="p.json") -> Path:
    """The organic pair's profile, with `acceptance` as its block."""
    path = tmp_path / name
    Profile.load(ORGANIC_PROFILE).model_copy(update={"acceptance": acceptance}).save(path)
    return path


def scenario(acceptance: dict, k: int = 4, costs: dict | None = None,
             draft: dict | None = None) -> Scenario:
    return Scenario.load_from_dict({
        "hardware": "h200", "model": "qwen3-0.6b",
        "draft": draft or {"model": "qwen3-0.6b", "quant": "int4-last-14", "device": "gpu"},
        "spec": {"k": k, "acceptance": acceptance}, "costs": costs,
        "workload": {"arrivals": {"process": "poisson", "rate": 20.0}, "requests": 40,
                     "prompt_tokens": {"dist": "fixed", "value": 128},
                     "output_tokens": {"dist": "fixed", "value": 48}, "seed": 3}})


def test_the_block_counts_the_drafts_lengths():
    b = block()
    assert b.drafts == len(LENGTHS) == b.prompts * b.rounds
    for i in range(b.k):  # reached i: kept at least i; accepted i: kept more than i
        assert b.reached[i] == sum(n >= i for n in LENGTHS)
        assert b.accepted[i] == sum(n > i for n in LENGTHS)
        assert b.conditional_rates[i] == pytest.approx(b.accepted[i] / b.reached[i], abs=1e-6)
    assert b.unconditional_rates()[0] == b.accepted[0] / 20
    assert b.acceptance_length() == pytest.approx(1 + np.mean(LENGTHS))
    # the distribution of kept lengths the rates give is the measured one
    counts = np.bincount(LENGTHS, minlength=b.k + 1) / len(LENGTHS)
    assert np.allclose(pmf_from_rates(b.conditional_rates), counts, atol=1e-5)


def test_the_profile_saves_and_reads_the_block(tmp_path):
    path = profile_with(tmp_path, block())
    assert Profile.load(path).acceptance == block()
    assert Profile.load(OLDER_PROFILE).acceptance is None  # optional: older files read
    bundled = Profile.load(ORGANIC_PROFILE).acceptance  # kestrel calibrate on the H200
    assert bundled.draft_quant == "int4-last-14" and bundled.k == 8
    assert 0.3 <= bundled.conditional_rates[0] <= 0.9
    text = path.read_text()
    assert '"conditional_rates"' in text and '"reached"' in text


@pytest.mark.parametrize("change, message", [
    ({"accepted": [17, 13, 9, 7, 5, 6]}, r"accepted\[5\] = 6 exceeds reached\[5\] = 5"),
    ({"reached": [20, 16, 13, 9, 7, 5]}, r"reached\[1\] = 16 must equal accepted\[0\] = 17"),
    ({"conditional_rates": [0.9] * 6}, r"conditional_rates\[0\] = 0.9 but accepted\[0\]"),
    ({"k": 5}, "reached has 6 entries: expected k = 5"),
    ({"drafts": 21}, r"drafts \(21\) must equal prompts x rounds"),
    ({"draft_quant": "int3"}, "'int3' is not a quantization"),
])
def test_a_block_whose_counts_do_not_add_up_is_refused(tmp_path, change, message):
    data = block().model_dump() | change
    path = profile_with(tmp_path, None)
    doc = Profile.load(path).model_dump(mode="json", exclude_none=True) | {"acceptance": data}
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=message) as err:
        Profile.load(path)
    assert "acceptance" in str(err.value) and str(path) in str(err.value)


def test_merged_profiles_keep_the_one_block(tmp_path):
    with_block = Profile.load(profile_with(tmp_path, block()))
    without = Profile.load(ORGANIC_PROFILE).model_copy(update={"acceptance": None})
    assert with_block.merge(without).acceptance == block()
    assert without.merge(with_block).acceptance == block()
    same = Profile.load(profile_with(tmp_path, block(), "q.json"))
    assert same.merge(with_block).acceptance == block()
    changed = Profile.load(profile_with(tmp_path, block([0] * 20), "r.json"))
    with pytest.raises(ConfigError, match="both profiles hold an acceptance measurement"):
        with_block.merge(changed)


def test_from_profile_takes_exactly_the_measured_rates(tmp_path):
    b = block()
    path = profile_with(tmp_path, b)
    sc = scenario({"from_profile": True, "on_hardware": "organic"}, k=4,
                  costs={"profile": str(path)})
    assert sc.spec.acceptance.measured == (str(path), b)
    assert sc.spec.acceptance.rates(4) == b.conditional_rates[:4]
    model = build_acceptance(sc.spec.acceptance, 4)
    assert np.array_equal(model.pmf, build_acceptance(
        sc.spec.acceptance.model_copy(update={"from_profile": False,
                                              "per_position": b.conditional_rates[:4]}),
        4).pmf)
    # the simulator draws the same lengths as from those rates given by hand
    given = scenario({"per_position": b.conditional_rates[:4]}, k=4,
                     costs={"profile": str(path)})
    measured, by_hand = (compute_metrics(simulate(s, trace="none"), s.slo)
                         for s in (sc, given))
    assert measured.spec_decode_num_drafts > 0
    assert measured.model_dump() == by_hand.model_dump()  # every metric, draw for draw
    # the header says where they came from
    text = describe_acceptance(sc.spec.acceptance, 4)
    assert "measured on NVIDIA H200 (bfloat16, cupy+graphs" in text and str(path) in text
    assert " ".join(f"{r:.2f}" for r in b.conditional_rates[:4]) in text
    assert "organic" in text


def test_from_profile_reads_its_own_profile_or_a_profile_hardware(tmp_path):
    b = block()
    path = profile_with(tmp_path, b)
    own = scenario({"from_profile": str(path)}, k=6, costs={"roofline": {}})
    assert own.spec.acceptance.rates(6) == b.conditional_rates
    data = own.model_dump(mode="json")
    assert data["spec"]["acceptance"]["from_profile"] == str(path)
    again = Scenario.load_from_dict(data)  # a dump validates again, to the same rates
    assert again.spec.acceptance.rates(6) == b.conditional_rates
    hardware = Scenario.load_from_dict({**data, "hardware": str(path), "costs": None,
                                        "spec": {"k": 2, "acceptance": {"from_profile": True}}})
    assert hardware.spec.acceptance.rates(2) == b.conditional_rates[:2]


def test_a_dump_without_from_profile_is_as_before():
    sc = scenario({"per_position": [0.5] * 4})
    assert "from_profile" not in sc.model_dump(mode="json")["spec"]["acceptance"]


COMMAND = ("kestrel calibrate --model qwen3-0.6b --draft qwen3-0.6b --draft-quant "
           "int4-last-14 --draft-device gpu")


def test_a_profile_without_the_block_is_refused_with_the_command(tmp_path):
    path = profile_with(tmp_path, None)
    with pytest.raises(ValueError, match="spec.acceptance.from_profile") as err:
        scenario({"from_profile": True}, costs={"profile": str(path)})
    assert f"profile {path} holds no acceptance measurement" in str(err.value)
    assert COMMAND in str(err.value)


def test_bad_combinations_are_refused_naming_the_key(tmp_path):
    path = profile_with(tmp_path, block())
    with pytest.raises(ValueError, match="exactly one of alpha, per_position, trace or "
                       r"from_profile \(got per_position, from_profile\)"):
        scenario({"from_profile": True, "per_position": [0.5] * 4},
                 costs={"profile": str(path)})
    with pytest.raises(ValueError, match="spec.acceptance.from_profile: the scenario names "
                       "no Profile"):
        scenario({"from_profile": True}, costs={"roofline": {}})
    with pytest.raises(ValueError, match="measured acceptance at k = 6, fewer positions than "
                       "the scenario's spec.k = 8"):
        scenario({"from_profile": True}, k=8, costs={"profile": str(path)})
    with pytest.raises(ValueError, match=r"draft qwen3-0.6b quantized int4-last-14, but the "
                       "scenario's draft.quant is int8"):
        scenario({"from_profile": str(path)}, costs={"roofline": {}},
                 draft={"model": "qwen3-0.6b", "quant": "int8"})
    with pytest.raises(ValueError, match="draft on the gpu, but the scenario's draft.device "
                       "is cpu"):
        scenario({"from_profile": str(path)}, costs={"roofline": {}},
                 draft={"model": "qwen3-0.6b", "quant": "int4-last-14", "device": "cpu"})
    with pytest.raises(ValueError, match="measured draft qwen3-0.6b, not the scenario's "
                       "draft.model qwen3-1.7b"):
        scenario({"from_profile": str(path)}, costs={"roofline": {}},
                 draft={"model": "qwen3-1.7b", "quant": "int4-last-14"})
    with pytest.raises(ValueError, match="acceptance profile file 'nope.json' not found"):
        scenario({"from_profile": "nope.json"})
    other_target = tmp_path / "8b.json"
    Profile.load(ROOT / "calibration" / "profiles" / "qwen3-8b_h200.json").model_copy(
        update={"acceptance": block()}).save(other_target)
    with pytest.raises(ValueError, match="measured target qwen3-8b, not the scenario's model "
                       "qwen3-0.6b"):
        scenario({"from_profile": str(other_target)}, costs={"roofline": {}})


def test_a_yaml_error_names_the_file_and_the_key(tmp_path):
    path = profile_with(tmp_path, None)
    yaml = tmp_path / "s.yaml"
    yaml.write_text(f"""model: qwen3-0.6b
draft: {{model: qwen3-0.6b, quant: int4-last-14}}
spec:
  k: 4
  acceptance: {{from_profile: true, on_hardware: organic}}
costs: {{profile: {path}}}
workload: {{arrivals: {{process: poisson, rate: 2}}, requests: 4}}
""")
    with pytest.raises(ConfigError) as err:
        load_scenario(yaml)
    text = str(err.value)
    assert str(yaml) in text and "spec.acceptance.from_profile" in text and COMMAND in text


def test_a_kept_organic_measurement_is_predicted_again_with_measured_rates(tmp_path):
    """An organic run never reads the rates (the target accepts for real), so a measurement
    kept with given rates stands for the scenario that takes them from a profile; a
    controlled run draws from them, so there they count."""
    from kestrel_cli.kept import differing

    path = profile_with(tmp_path, block())
    costs = {"profile": str(path)}
    kept = scenario({"per_position": [0.49, 0.76, 0.89, 0.77], "on_hardware": "organic"},
                    costs=costs).model_dump(mode="json")
    now = scenario({"from_profile": True, "on_hardware": "organic"}, costs=costs)
    assert differing(kept, now.model_dump(mode="json")) == []
    controlled = scenario({"from_profile": True, "on_hardware": "controlled"}, costs=costs)
    assert differing(kept, controlled.model_dump(mode="json")) == ["spec"]
    longer = scenario({"from_profile": True, "on_hardware": "organic"}, k=5, costs=costs)
    assert differing(kept, longer.model_dump(mode="json")) == ["spec"]  # k is run


def test_kestrel_run_says_where_the_acceptance_came_from(tmp_path):
    from typer.testing import CliRunner

    from kestrel_cli.app import app

    path = profile_with(tmp_path, block())
    yaml = tmp_path / "organic.yaml"
    yaml.write_text(f"""name: organic
model: qwen3-0.6b
draft: {{model: qwen3-0.6b, quant: int4-last-14}}
spec: {{k: 3, acceptance: {{from_profile: true, on_hardware: organic}}}}
costs: {{profile: {path}}}
workload: {{arrivals: {{process: poisson, rate: 5}}, requests: 6}}
""")
    result = CliRunner().invoke(app, ["run", str(yaml), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    rates = " ".join(f"{r:.2f}" for r in block().conditional_rates[:3])
    assert f"acceptance: per position {rates}, measured on NVIDIA H200" in result.output
    assert f"from profile {path}" in " ".join(result.output.split())
