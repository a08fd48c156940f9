"""A runtime without step graphs (the CPU, or graphs off): Profile.runtime with no batch
buckets, each step at its own batch, its prompt chunks one forward each (RuntimeInfo.chunks
"per_chunk", as kestrel_rt/serve/forward.py prefill_forward runs them there too)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kestrel_sim.costs.base import Chunk
from kestrel_sim.costs.build import build_costs, describe_costs
from kestrel_sim.costs.calibrated import CalibratedRoofline
from kestrel_sim.costs.profile import ProfileCost, ProfileFits
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.profile import Profile
from kestrel_sim.runtime_info import RuntimeInfo
from kestrel_sim.scenario import Scenario

H200 = load_hardware("h200")
HOST_MS = 3.0  # per forward of a prompt chunk
EAGER = {"chunks": "per_chunk"}  # what calibrate writes without graphs


def profile(runtime: dict | None = EAGER, device: str = "gpu") -> Profile:
    """qwen3-8b rows timed by the H200 roofline, on `device`; prompt chunks measured one
    forward each, each with its host time."""
    cost = RooflineCost(H200, preset("qwen3-8b"))

    def ms(stage, b, m, c):
        return cost.seconds(stage, b, m, c) * 1e3

    rows = [{"stage": st, "batch": b, "tokens_per_seq": m, "context": c, "ms": ms(st, b, m, c)}
            for st, m in (("decode", 1), ("verify", 5)) for b in (1, 3, 5, 8, 16)
            for c in (256, 4096)]
    rows += [{"stage": "prefill", "batch": b, "tokens_per_seq": n, "context": 0,
              "ms": b * (ms("prefill", 1, n, 0) + HOST_MS)} for b in (1, 2, 4) for n in (300, 2048)]
    fp = {"device": "NVIDIA H200" if device == "gpu" else "Intel(R) Xeon(R) Platinum 8480+",
          "model": "qwen3-8b"}
    return Profile.model_validate({"fingerprint": fp, "runtime": runtime,
                                   "measurements": [{**r, "device": device} for r in rows]})


def test_no_buckets_validate_and_leave_every_step_at_its_own_shape():
    info = RuntimeInfo(chunks="per_chunk")
    assert info.batch_buckets == [] and not info.graphs and info.per_chunk
    assert RuntimeInfo(batch_buckets=[]) == RuntimeInfo()
    for stage, b, m in (("decode", 3, 1), ("verify", 5, 5), ("draft", 33, 2), ("prefill", 2, 300)):
        assert info.run_shape(stage, b, m) == (b, m)
    assert info.bucket(7, 1) == 7
    # step graphs still pad, as before
    assert RuntimeInfo(batch_buckets=[1, 2, 4, 8]).bucket(3, 1) == 4


def test_files_with_and_without_buckets_load_and_bad_ones_are_named(tmp_path):
    p = profile()
    p.save(tmp_path / "p.json")
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["runtime"]["chunks"] == "per_chunk" and saved["runtime"]["batch_buckets"] == []
    assert Profile.load(tmp_path / "p.json") == p
    del saved["runtime"]["batch_buckets"]  # absent: no step graphs either
    (tmp_path / "absent.json").write_text(json.dumps(saved))
    assert Profile.load(tmp_path / "absent.json").runtime == p.runtime
    # older files: buckets (a graphed GPU run) or no runtime at all
    assert profile({"batch_buckets": [1, 2, 4]}).runtime.graphs
    assert profile(None).runtime is None
    saved["runtime"]["prefill_buckets"] = [64, 128]  # prefill graphs without step graphs
    (tmp_path / "bad.json").write_text(json.dumps(saved, indent=1))
    with pytest.raises(ConfigError, match=r"runtime.*prefill_buckets need batch_buckets"):
        Profile.load(tmp_path / "bad.json")
    saved["runtime"] = {"batch_buckets": [4, 2]}
    (tmp_path / "desc.json").write_text(json.dumps(saved, indent=1))
    with pytest.raises(ConfigError, match=r"batch_buckets must be ascending positive sizes"):
        Profile.load(tmp_path / "desc.json")


@pytest.mark.parametrize("device", ["gpu", "cpu"], ids=["graphs-off", "the-cpu"])
def test_chunks_cost_a_forward_each_and_steps_are_unpadded(device):
    eager, old = ProfileCost(profile(device=device)), ProfileCost(profile(None, device))
    assert eager.device == device and eager.per_chunk and eager.runtime is None
    assert not old.per_chunk
    one = eager.seconds("prefill", 1, 300, 0)
    for b in (2, 3, 8):
        assert eager.seconds("prefill", b, 300, 0) == pytest.approx(b * one)
    for stage, m in (("decode", 1), ("verify", 5)):  # each step at its own batch
        assert eager.seconds(stage, 3, m, 1000) == pytest.approx(old.seconds(stage, 3, m, 1000))
    # a mixed step (no mixed rows): the step's forward, then each chunk's
    step = eager.seconds("verify", 3, 5, 1000)
    assert eager.mixed_seconds("verify", 3, 5, 1000, Chunk(2, 300, 0)) == pytest.approx(
        step + 2 * one)


def test_overlap_and_round_pricing_read_no_buckets():
    fits = ProfileFits(profile())
    decode = fits.models["decode", "gpu"]
    assert fits.step_ms("decode", 3, 1, 1000) == pytest.approx(decode.ms(3, 1, 1000))
    prefill = fits.models["prefill", "gpu"]
    assert fits.step_ms("prefill", 2, 300, 0) == pytest.approx(2 * prefill.ms(1, 300, 0))
    assert fits.step_shares("prefill", 2, 300, 0) == prefill.shares(1, 300, 0)
    from kestrel_sim.profile import Measurement

    row = Measurement(stage="round", batch=3, tokens_per_seq=1, context=1000, ms=20.0)
    assert fits.round_stages_ms(row) == pytest.approx(decode.ms(3, 1, 1000))


def test_a_calibrated_roofline_and_the_description_cope_with_no_buckets(tmp_path):
    fits = ProfileFits(profile())
    moved = CalibratedRoofline(fits, H200, load_hardware("h100"), preset("qwen3-8b"), "p")
    assert moved.runtime is None and moved.per_chunk
    one = moved.seconds("prefill", 1, 512, 0)
    assert moved.seconds("prefill", 3, 512, 0) == pytest.approx(3 * one)
    profile().save(tmp_path / "p.json")
    sc = Scenario.load_from_dict({
        "hardware": "p.json", "workload": {"arrivals": {"process": "poisson", "rate": 2.0},
                                           "requests": 10}}, base_dir=tmp_path)
    costs = build_costs(sc, np.random.default_rng(0))
    assert costs.target.per_chunk
    assert "graph batch buckets" not in describe_costs(costs)
