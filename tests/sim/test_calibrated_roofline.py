"""The roofline calibrated from a profile: on the measured device it is the profile's
physical fit; on another it keeps the fractions of bandwidth and flop rate achieved."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.build import build_costs, describe_costs
from kestrel_sim.costs.calibrated import CalibratedRoofline
from kestrel_sim.costs.profile import ProfileCost, ProfileFits
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.profile import Profile
from kestrel_sim.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "calibration" / "profiles" / "qwen3-8b_h200.json"
H200, H100 = load_hardware("h200"), load_hardware("h100")
POINTS = [("decode", 1, 1, 128), ("decode", 64, 1, 4000), ("verify", 16, 5, 2000),
          ("prefill", 1, 2048, 0), ("prefill", 4, 512, 1024), ("draft", 8, 1, 1000)]


def fits() -> ProfileFits:
    return ProfileFits(Profile.load(BUNDLED))


def faster(tmp_path, **changes):
    """The H200's description with some rates changed, as a hardware YAML."""
    data = H200.model_dump(exclude={"links", "default_link"}) | {"name": "h200-x"} | changes
    path = tmp_path / "x.yaml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in data.items() if v is not None) + "\n")
    return load_hardware(str(path))


def test_on_the_measured_device_it_is_the_profiles_physical_fit():
    f = fits()
    target = CalibratedRoofline(f, H200, H200, preset("qwen3-8b"), str(BUNDLED))
    draft = CalibratedRoofline(f, H200, H200, preset("qwen3-0.6b"), str(BUNDLED), role="draft")
    physical = ProfileCost(Profile.load(BUNDLED), correction=False)
    for stage, b, m, c in POINTS:
        cost = draft if stage == "draft" else target
        assert cost.seconds(stage, b, m, c) == pytest.approx(physical.seconds(stage, b, m, c),
                                                             rel=1e-12)
    # so its error on the profile's own points is the fit's: within the report's maximum
    profile = Profile.load(BUNDLED)
    errors = [abs(target.seconds(mm.stage, mm.batch, mm.tokens_per_seq, mm.context) * 1e3
                  / mm.ms - 1) for mm in profile.measurements
              if mm.stage in ("decode", "verify", "prefill", "correction")]
    assert np.median(errors) < 0.08


def test_memory_bound_time_scales_with_bandwidth(tmp_path):
    f = fits()
    wide = faster(tmp_path, mem_bandwidth_tb_s=2 * H200.mem_bandwidth_tb_s)
    a = CalibratedRoofline(f, H200, H200, preset("qwen3-8b"), "p")
    b = CalibratedRoofline(f, H200, wide, preset("qwen3-8b"), "p")
    terms = a.model("decode").terms
    for batch, c in [(1, 128), (8, 2000), (64, 4000)]:
        on_a, on_b = a.seconds("decode", batch, 1, c), b.seconds("decode", batch, 1, c)
        model = a.model("decode")
        serial = model.physical_ms(batch, 1, c) - terms.overhead - (
            terms.weights * model.work.weight_bytes(batch)
            + terms.kv * model.work.kv_bytes(batch, 1, c))
        memory = on_a * 1e3 - terms.overhead - serial  # weights and KV read
        assert on_b * 1e3 == pytest.approx(terms.overhead + serial + memory / 2, rel=1e-9)
    assert b.efficiencies() == a.efficiencies()  # the same fractions of each device's rates


def test_compute_bound_prefill_scales_with_the_flop_rate(tmp_path):
    f = fits()
    quick = faster(tmp_path, matmul_tflops=2 * H200.matmul_tflops,
                   attention_tflops=2 * 0.6 * H200.matmul_tflops)
    a = CalibratedRoofline(f, H200, H200, preset("qwen3-8b"), "p")
    b = CalibratedRoofline(f, H200, quick, preset("qwen3-8b"), "p")
    over = a.model("prefill").terms.overhead
    kv = a.model("prefill").terms.kv * a.model("prefill").work.kv_bytes(1, 8192, 0)
    on_a, on_b = (c.seconds("prefill", 1, 8192, 0) * 1e3 - over - kv for c in (a, b))
    assert on_b == pytest.approx(on_a / 2, rel=1e-9)


def test_another_model_keeps_the_efficiencies_and_scales_overhead_by_layers():
    f = fits()
    big = CalibratedRoofline(f, H200, H200, preset("qwen3-14b"), "p")
    small = CalibratedRoofline(f, H200, H200, preset("qwen3-8b"), "p")
    assert big.model("decode").terms.overhead == pytest.approx(
        small.model("decode").terms.overhead * 40 / 36)
    assert big.model("decode").terms.kv == small.model("decode").terms.kv
    assert big.seconds("decode", 1, 1, 128) > 1.5 * small.seconds("decode", 1, 1, 128)


def scenario(costs: dict, hardware="h100", **extra) -> Scenario:
    return Scenario.load_from_dict({
        "hardware": hardware, "model": "qwen3-8b", "costs": costs,
        "workload": {"arrivals": {"process": "poisson", "rate": 4.0}, "requests": 30},
        **extra}, base_dir=ROOT / "scenarios")


def test_scenario_syntax_and_what_the_result_says():
    sc = scenario({"roofline": {"calibrated_from": "../calibration/profiles/qwen3-8b_h200.json"}},
                  draft={"model": "qwen3-0.6b"}, spec={"k": 4, "acceptance": {"alpha": 0.6}})
    costs = build_costs(sc, np.random.default_rng(0))
    assert costs.source == "calibrated-roofline" and costs.hardware.name == "h100"
    said = describe_costs(costs)
    assert said.startswith(
        "roofline calibrated from qwen3-8b_h200.json (measured on h200, applied to h100)")
    assert "round overhead" in said  # the profile's round rows travel with it
    # the H100's 2.9 TB/s against the H200's 4.2: a memory-bound step is slower
    h200 = scenario({"roofline": {"calibrated_from": str(BUNDLED)}}, hardware="h200")
    on_h200 = build_costs(h200, np.random.default_rng(0)).target
    assert costs.target.seconds("decode", 1, 1, 128) > 1.2 * on_h200.seconds("decode", 1, 1, 128)
    assert isinstance(costs.draft, CalibratedRoofline)  # the profile's own draft rows, moved
    run = simulate(sc)
    assert run.meta["costs"] == "calibrated-roofline" and run.meta["calibrated"]
    assert all(r.finish for r in run.requests)
    uncalibrated = build_costs(scenario({"roofline": {}}), np.random.default_rng(0))
    assert describe_costs(uncalibrated) == "uncalibrated roofline (h100)"


def test_calibration_fields_are_checked(tmp_path):
    # (a scenario from a dict raises pydantic's ValidationError, a ValueError)
    with pytest.raises(ValueError, match="launch_us cannot be given with calibrated_from"):
        scenario({"roofline": {"calibrated_from": str(BUNDLED), "launch_us": 2}})
    with pytest.raises(ValueError, match="measured_on only applies with calibrated_from"):
        scenario({"roofline": {"measured_on": "h200"}})
    with pytest.raises(ValueError, match="calibrated_from file 'nope.json' not found"):
        scenario({"roofline": {"calibrated_from": "nope.json"}})
    # a profile of a device without a bundled description needs measured_on
    profile = Profile.load(BUNDLED)
    odd = profile.model_copy(update={"fingerprint": profile.fingerprint.model_copy(
        update={"device": "Some GPU"})})
    odd.save(tmp_path / "odd.json")
    sc = scenario({"roofline": {"calibrated_from": str(tmp_path / "odd.json")}})
    with pytest.raises(ConfigError, match="give costs.roofline.measured_on"):
        build_costs(sc, np.random.default_rng(0))
    sc = scenario({"roofline": {"calibrated_from": str(tmp_path / "odd.json"),
                                "measured_on": "h200"}})
    assert build_costs(sc, np.random.default_rng(0)).target.measured_on.name == "h200"
