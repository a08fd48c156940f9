"""Stage costs: roofline arithmetic, MoE expert counting, cost tables, profile fits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.build import build_costs, describe_costs
from kestrel_sim.costs.calibrated import CalibratedRoofline
from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.table import TableCost
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.profile import Profile
from kestrel_sim.scenario import Scenario, TableCosts

H200 = load_hardware("h200")


def params(shape) -> int:
    h, q, kv = shape.hidden_size, shape.num_attention_heads * shape.head_dim, \
        shape.num_key_value_heads * shape.head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * shape.intermediate_size
    return shape.num_hidden_layers * per_layer + shape.vocab_size * h  # lm_head, no embedding


def test_batch1_decode_is_weight_bandwidth_bound():
    shape = preset("qwen3-8b")
    cost = RooflineCost(H200, shape)
    fixed = (36 * H200.kernels_per_layer * H200.launch_us + H200.step_overhead_us) * 1e-6
    kv_bytes = 2 * shape.kv_elements_per_token * (0 + 2)  # no context, 1 token read+written
    expected = (2 * params(shape) + kv_bytes) / 4.2e12 + fixed
    assert cost.seconds("decode", 1, 1, 0) == pytest.approx(expected, rel=1e-9)
    # 8B params in bf16 over 4.2 TB/s: about 3.6 ms of weights
    assert 3.4e-3 < cost.seconds("decode", 1, 1, 0) < 4.2e-3


def test_large_prefill_is_compute_bound():
    shape = preset("qwen3-8b")
    cost = RooflineCost(H200, shape)
    t = cost.seconds("prefill", 1, 8192, 0)
    gemm = 2 * 8192 * (params(shape) - shape.vocab_size * shape.hidden_size) / 777e12
    assert t > gemm  # gemm plus attention plus overheads
    assert t < 1.5 * gemm


def test_context_costs_kv_reads():
    cost = RooflineCost(H200, preset("qwen3-8b"))
    short, long = cost.seconds("decode", 32, 1, 100), cost.seconds("decode", 32, 1, 8100)
    kv_per_token = 2 * preset("qwen3-8b").kv_elements_per_token
    assert long - short == pytest.approx(32 * 8000 * kv_per_token / 4.2e12, rel=1e-6)


def test_verify_prices_logits_at_every_position():
    cost = RooflineCost(H200, preset("qwen3-8b"))
    assert cost.seconds("verify", 64, 5, 0) > cost.seconds("prefill", 64, 5, 0)


def test_moe_counts_touched_experts():
    shape = preset("qwen3-30b-a3b")
    cost = RooflineCost(H200, shape)
    e, k = shape.num_experts, shape.num_experts_per_tok
    assert cost.touched_experts(1) == pytest.approx(k)
    assert cost.touched_experts(10) == pytest.approx(e * (1 - (1 - k / e) ** 10))
    assert cost.touched_experts(10_000) == pytest.approx(e)
    # a batch of 1 reads ~3B active params, a batch of 64 nearly all 30B
    one, many = cost.seconds("decode", 1, 1, 0), cost.seconds("decode", 64, 1, 0)
    assert 4 < many / one < 12


def test_table_interpolates_in_batch_and_adds_per_token():
    t = TableCost(TableCosts(verify={1: 2.0, 9: 6.0}, prefill=1.0, prefill_per_token=0.01))
    assert t.seconds("verify", 1, 5, 0) == pytest.approx(2e-3)
    assert t.seconds("verify", 5, 5, 0) == pytest.approx(4e-3)
    assert t.seconds("verify", 100, 5, 0) == pytest.approx(6e-3)  # clamped
    assert t.seconds("prefill", 2, 100, 0) == pytest.approx(1e-3 + 2e-3)
    with pytest.raises(ConfigError, match="no entry for stage 'decode'"):
        t.seconds("decode", 1, 1, 0)


def test_table_replays_a_published_breakdown():
    """draft 60% / verify 10% / correction 30% of a round, as in the original design
    (rounds apart from prefill: the alternate schedule never puts a chunk in a verify)."""
    sc = Scenario.load_from_dict({
        "draft": {"model": "qwen3-0.6b"},
        "spec": {"k": 4, "correction": "separate", "acceptance": {"alpha": 0.6}},
        "serving": {"prefill_schedule": "alternate"},
        "costs": {"table": {"prefill": 5.0, "draft": 1.5, "verify": 1.0, "correction": 3.0}},
        "workload": {"arrivals": {"process": "poisson", "rate": 5.0}, "requests": 50},
    })
    tr = simulate(sc)
    busy = {}
    for s in tr.spans:
        if s.kind in ("draft", "verify", "correction"):
            busy[s.kind] = busy.get(s.kind, 0.0) + s.end - s.start
    total = sum(busy.values())
    assert busy["draft"] / total == pytest.approx(0.6)
    assert busy["verify"] / total == pytest.approx(0.1)
    assert busy["correction"] / total == pytest.approx(0.3)


def synthetic_profile(stages=("prefill", "decode", "verify", "draft")) -> Profile:
    """Measurements made by the roofline itself (a stand-in for a measured profile) on a
    power-of-two batch grid: between grid points the fit is piecewise linear, so near the
    roofline's knee it can be a few percent off."""
    target = RooflineCost(H200, preset("qwen3-8b"))
    draft = RooflineCost(H200, preset("qwen3-0.6b"))
    rows = []
    grid = {"prefill": ([1, 2], [128, 512, 2048], [0]),
            "decode": ([1, 2, 4, 8, 16, 32, 64], [1], [256, 4096]),
            "verify": ([1, 2, 4, 8, 16, 32, 64], [5], [256, 4096]),
            "draft": ([1, 2, 4, 8, 16, 32, 64], [1], [256, 4096])}
    for stage in stages:
        cost = draft if stage == "draft" else target
        bs, ms, cs = grid[stage]
        for b in bs:
            for m in ms:
                for c in cs:
                    rows.append({"stage": stage, "batch": b, "tokens_per_seq": m, "context": c,
                                 "ms": cost.seconds(stage, b, m, c) * 1e3, "samples": 5})
    return Profile.model_validate({
        "fingerprint": {"device": "NVIDIA H200", "model": "qwen3-8b", "draft_model": "qwen3-0.6b"},
        "measurements": rows,
    })


@pytest.mark.parametrize("stage,b,m,c", [
    ("decode", 6, 1, 1000), ("decode", 48, 1, 3000), ("verify", 24, 5, 2000),
    ("verify", 48, 5, 1000), ("draft", 12, 1, 700), ("prefill", 1, 1024, 0),
])
def test_profile_interpolates_between_measurements(stage, b, m, c):
    fit = ProfileCost(synthetic_profile())
    truth = RooflineCost(H200, preset("qwen3-0.6b" if stage == "draft" else "qwen3-8b"))
    assert fit.seconds(stage, b, m, c) == pytest.approx(truth.seconds(stage, b, m, c), rel=0.05)


def test_profile_extrapolates_along_the_last_segment():
    fit = ProfileCost(synthetic_profile())
    t2k, t4k = fit.seconds("prefill", 1, 2048, 0), fit.seconds("prefill", 1, 4096, 0)
    assert t4k > 1.8 * t2k  # compute-bound growth continues, not clamped flat


def test_profile_missing_stage_is_a_clear_error(tmp_path):
    path = tmp_path / "p.json"
    synthetic_profile(stages=("prefill", "decode")).save(path)
    assert Profile.load(path).stages() == {"prefill", "decode"}
    sc = Scenario.load_from_dict({
        "hardware": "p.json",
        "draft": {"model": "qwen3-0.6b"}, "spec": {"k": 4, "acceptance": {"alpha": 0.5}},
        "workload": {"arrivals": {"process": "poisson", "rate": 1.0}},
    }, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"no measurements for stage\(s\) verify"):
        build_costs(sc, np.random.default_rng(0))


def test_scenario_runs_on_a_profile(tmp_path):
    path = tmp_path / "p.json"
    synthetic_profile().save(path)
    data = json.loads(path.read_text())
    assert data["fingerprint"]["device"] == "NVIDIA H200"
    sc = Scenario.load_from_dict({
        "hardware": "p.json",
        "draft": {"model": "qwen3-0.6b"}, "spec": {"k": 4, "acceptance": {"alpha": 0.6}},
        "workload": {"arrivals": {"process": "poisson", "rate": 10.0}, "requests": 100},
    }, base_dir=tmp_path)
    costs = build_costs(sc, np.random.default_rng(0))
    assert costs.source == "profile" and costs.hardware.name == "h200"  # from the fingerprint
    draft_roof = RooflineCost(H200, preset("qwen3-0.6b"))
    assert isinstance(costs.draft, ProfileCost)  # the profile measured this draft
    # ... but not the draft's own prompt pass (prefill rows measure the target): the
    # profile's prefill terms over the draft's shape, near the truth they were made from
    prompt = costs.draft.seconds("prefill", 1, 512, 0)
    assert prompt == pytest.approx(draft_roof.seconds("prefill", 1, 512, 0), rel=0.05)
    assert prompt < 0.5 * costs.target.seconds("prefill", 1, 512, 0)
    tr = simulate(sc)
    assert tr.meta["costs"] == "profile" and all(r.finish for r in tr.requests)


def test_cpu_draft_uses_cpu_hardware():
    sc = Scenario.load_from_dict({
        "draft": {"model": "qwen3-0.6b", "device": "cpu"},
        "spec": {"k": 4, "acceptance": {"alpha": 0.6}},
        "workload": {"arrivals": {"process": "poisson", "rate": 1.0}},
    })
    costs = build_costs(sc, np.random.default_rng(0))
    assert costs.draft_hardware.name == "cpu-xeon"
    gpu = RooflineCost(H200, preset("qwen3-0.6b")).seconds("draft", 1, 1, 500)
    assert costs.draft.seconds("draft", 1, 1, 500) > 10 * gpu


def test_profile_of_another_model_is_refused(tmp_path):
    synthetic_profile().save(tmp_path / "p.json")
    sc = Scenario.load_from_dict({
        "hardware": "p.json", "model": "qwen3-14b",
        "workload": {"arrivals": {"process": "poisson", "rate": 1.0}},
    }, base_dir=tmp_path)
    with pytest.raises(ConfigError, match="measures qwen3-8b but the scenario's model is"):
        build_costs(sc, np.random.default_rng(0))


def test_profile_prices_correction_as_decode_and_other_drafts_by_its_terms(tmp_path):
    synthetic_profile().save(tmp_path / "p.json")
    sc = Scenario.load_from_dict({
        "hardware": "p.json", "draft": {"model": "qwen3-1.7b"},
        "spec": {"k": 4, "correction": "separate", "acceptance": {"alpha": 0.6}},
        "workload": {"arrivals": {"process": "poisson", "rate": 1.0}},
    }, base_dir=tmp_path)
    costs = build_costs(sc, np.random.default_rng(0))
    assert costs.target.seconds("correction", 8, 1, 900) == costs.target.seconds("decode", 8, 1, 900)
    # the profile's draft stage measured qwen3-0.6b, so a 1.7b draft is priced by the
    # profile's decode terms over the 1.7b's shape (a roofline calibrated on this device)
    assert isinstance(costs.draft, CalibratedRoofline)
    truth = RooflineCost(H200, preset("qwen3-1.7b"))
    for b, c in [(1, 100), (16, 2000), (64, 4000)]:
        got = costs.draft.seconds("draft", b, 1, c)
        assert got == pytest.approx(truth.seconds("draft", b, 1, c), rel=0.05)
    assert "draft: the profile's decode and prefill terms" in describe_costs(costs)


def test_model_shape_from_a_config_json_folder(tmp_path):
    from kestrel_sim.costs.shape import model_shape

    cfg = preset("qwen3-30b-a3b").model_dump(exclude={"name", "architecture"})
    cfg["mlp_only_layers"] = []
    cfg.update(architectures=["Qwen3MoeForCausalLM"], torch_dtype="bfloat16", model_type="qwen3_moe")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_shape(str(tmp_path))
    assert shape.is_moe and shape.num_experts == 128 and shape.hidden_size == 2048
    ours = RooflineCost(H200, shape).seconds("decode", 4, 1, 100)
    assert ours == RooflineCost(H200, preset("qwen3-30b-a3b")).seconds("decode", 4, 1, 100)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConfigError, match="does not describe a Qwen3 model"):
        model_shape(str(tmp_path))


def test_bad_hardware_yaml_names_file_line_and_key(tmp_path):
    path = tmp_path / "gpu.yaml"
    path.write_text("name: x\nmemory_gb: 80\nmem_bandwidth_tb_s: -2\nmatmul_tflops: 700\n")
    with pytest.raises(ConfigError, match=r"gpu.yaml:3: mem_bandwidth_tb_s: must be > 0"):
        load_hardware(str(path))
    path.write_text("name: x\nmemory_gb: 80\nmem_bandwidth_tb_s: 2\nmatmul_tflops: 700\n")
    assert load_hardware(str(path)).mem_bandwidth_tb_s == 2
