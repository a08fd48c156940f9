"""A step's prompt chunks priced as the runtime runs them (RuntimeInfo.chunks): "per_chunk",
one [1, m] forward per chunk (kestrel_rt/serve/forward.py prefill_forward), so b chunks
cost b times one; "batched" (profiles without the key) one [b, m] forward, as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel_sim.costs.base import Chunk
from kestrel_sim.costs.calibrated import CalibratedRoofline
from kestrel_sim.costs.profile import ProfileCost, ProfileFits
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.profile import Profile
from kestrel_sim.runtime_info import RuntimeInfo

H200, H100 = load_hardware("h200"), load_hardware("h100")
BUCKETS = [1, 2, 4, 8, 16, 32, 64]
PREFILL_BUCKETS = [32, 64, 128, 256, 384, 512, 1024, 2048]
HOST_MS = 3.0  # per forward of a prompt chunk: what makes a batched fit sub-linear
BUNDLED = Path(__file__).parents[2] / "calibration" / "profiles"


def rows(cost, stage, batches, ms_, contexts, name=None, extra_ms=0.0, device="gpu"):
    return [{"stage": name or stage, "batch": b, "tokens_per_seq": m, "context": c,
             "device": device, "ms": cost.seconds(stage, b, m, c) * 1e3 + extra_ms}
            for b in batches for m in ms_ for c in contexts]


def per_chunk_rows(cost, stage, batches, ms_, name=None, device="gpu"):
    """Prefill rows as a per-chunk runtime measures them: b forwards of [1, m], each with
    its host time."""
    return [{"stage": name or stage, "batch": b, "tokens_per_seq": m, "context": 0,
             "device": device, "ms": b * (cost.seconds("prefill", 1, m, 0) * 1e3 + HOST_MS)}
            for b in batches for m in ms_]


def profile(chunks: str | None = "per_chunk", mixed: bool = True) -> Profile:
    """qwen3-8b with a qwen3-0.6b draft, timed by the roofline plus a host time per prompt
    chunk's forward; the draft's prompt pass measured at batch 1 only (on the GPU and on
    the CPU), as calibration measures it; `chunks`: the runtime's key (None: absent)."""
    target, draft = RooflineCost(H200, preset("qwen3-8b")), RooflineCost(H200, preset("qwen3-0.6b"))
    measured = (rows(target, "decode", BUCKETS, [1], [256, 4096])
                + rows(target, "verify", BUCKETS, [5], [256, 4096])
                + per_chunk_rows(target, "prefill", [1, 2, 4], [512, 2048])
                + rows(draft, "draft", BUCKETS, [1], [256, 4096])
                + per_chunk_rows(draft, "prefill", [1], [512, 2048], "draft_prefill")
                + per_chunk_rows(draft, "prefill", [1], [512, 2048], "draft_prefill", "cpu"))
    if mixed:  # a verify and ONE chunk, as calibration measures a mixed step
        for b in (4, 32):
            for n in (512, 2048):
                ms = (target.seconds("verify", b, 5, 512) * 1e3
                      + target.seconds("prefill", 1, n, 0) * 1e3 + HOST_MS)
                measured.append({"stage": "mixed", "batch": b, "tokens_per_seq": 5,
                                 "context": 512, "chunk_batch": 1, "chunk_tokens": n,
                                 "chunk_context": 0, "ms": ms})
    runtime = {"batch_buckets": BUCKETS, "prefill_buckets": PREFILL_BUCKETS}
    if chunks is not None:
        runtime["chunks"] = chunks
    return Profile.model_validate({
        "fingerprint": {"device": "NVIDIA H200", "model": "qwen3-8b", "draft_model": "qwen3-0.6b"},
        "runtime": runtime, "measurements": measured})


def costs(p: Profile, device: str = "gpu") -> tuple[ProfileCost, ProfileCost]:
    """(target's cost, draft's cost) of a profile, on `device` for the draft."""
    fits = ProfileFits(p, preset("qwen3-8b"), preset("qwen3-0.6b"))
    return (ProfileCost(p, fits=fits),
            ProfileCost(p, stages=("draft", "draft_prefill"), fits=fits, device=device))


@pytest.mark.parametrize("m", [512, 300, 2048])
def test_b_chunks_cost_b_forwards_of_one_where_the_runtime_runs_per_chunk(m):
    target, draft = costs(profile())
    for cost in (target, draft):  # prefill, and the draft's draft_prefill
        one = cost.seconds("prefill", 1, m, 0)
        for b in (2, 3, 4, 8):
            assert cost.seconds("prefill", b, m, 0) == pytest.approx(b * one)
        # each chunk at its prefill graph's length (300 -> 384), as before
        assert cost.seconds("prefill", 2, m, 0) == pytest.approx(
            2 * cost.seconds("prefill", 1, next(x for x in PREFILL_BUCKETS if x >= m), 0))
    # the draft's rows are at batch 1 only: batched, its fit extrapolates sub-linearly
    _, batched = costs(profile(chunks=None))
    assert batched.seconds("prefill", 1, m, 0) == pytest.approx(draft.seconds("prefill", 1, m, 0))
    assert batched.seconds("prefill", 4, m, 0) < 0.8 * draft.seconds("prefill", 4, m, 0)


def test_a_cpu_draft_runs_its_chunks_per_chunk_too():
    _, cpu = costs(profile(), device="cpu")
    assert cpu.runtime is None and cpu.per_chunk  # no graph padding on a CPU
    one = cpu.seconds("prefill", 1, 512, 0)
    assert one == pytest.approx(profile().rows("draft_prefill", "cpu")[0].ms * 1e-3, rel=1e-6)
    assert cpu.seconds("prefill", 3, 512, 0) == pytest.approx(3 * one)


def test_without_the_key_chunks_are_priced_as_before():
    p = profile(chunks=None)
    assert p.runtime.chunks == "batched" and not p.runtime.per_chunk
    target, draft = costs(p)
    fits = target.fits
    for cost, stage in ((target, "prefill"), (draft, "draft_prefill")):
        model = fits.models[stage, "gpu"]
        for b, m in ((1, 512), (4, 300), (8, 2048)):
            run_m = p.runtime.prefill_tokens(m)
            assert cost.seconds("prefill", b, m, 0) == pytest.approx(model.ms(b, run_m, 0) * 1e-3)
    # a mixed step: the mixed fit at the whole chunk, as one forward
    mixed = fits.models["mixed", "gpu"]
    got = target.mixed_seconds("verify", 8, 5, 512, Chunk(3, 512, 0))
    assert got * 1e3 == pytest.approx(min(
        fits.models["verify", "gpu"].ms(8, 5, 512) + fits.models["prefill", "gpu"].ms(3, 512, 0),
        max(mixed.mixed_ms(8, 5, 512, Chunk(3, 512, 0)), fits.models["prefill", "gpu"].ms(3, 512, 0))))


def test_a_mixed_step_is_the_step_with_one_chunk_then_a_forward_per_other_chunk():
    per, old = costs(profile())[0], costs(profile(chunks=None))[0]
    one = per.seconds("prefill", 1, 512, 0)
    with_one = per.mixed_seconds("verify", 8, 5, 512, Chunk(1, 512, 0))
    assert with_one == pytest.approx(old.mixed_seconds("verify", 8, 5, 512, Chunk(1, 512, 0)))
    for n in (2, 3, 8):
        assert per.mixed_seconds("verify", 8, 5, 512, Chunk(n, 512, 0)) == pytest.approx(
            with_one + (n - 1) * one)
    # the batched reading prices 8 chunks as one forward: well under 8 forwards
    assert old.mixed_seconds("verify", 8, 5, 512, Chunk(8, 512, 0)) < 0.9 * (with_one + 7 * one)
    # without mixed rows: the step's forward, then each chunk's own
    bare = costs(profile(mixed=False))[0]
    step = bare.seconds("verify", 8, 5, 512)
    for n in (1, 3):
        assert bare.mixed_seconds("verify", 8, 5, 512, Chunk(n, 300, 0)) == pytest.approx(
            step + n * bare.seconds("prefill", 1, 300, 0))


def test_shares_of_chunks_run_per_chunk_are_those_of_one():
    target, _ = costs(profile())
    one = target.shares("prefill", 1, 512, 0)
    assert target.shares("prefill", 4, 512, 0) == pytest.approx(one)
    # a mixed step of many chunks leans to the chunks' shares
    few = target.shares("verify", 8, 5, 512, Chunk(1, 512, 0))
    many = target.shares("verify", 8, 5, 512, Chunk(8, 512, 0))
    assert abs(many.compute - one.compute) < abs(few.compute - one.compute)


def test_the_calibrated_roofline_carries_the_runtimes_chunks_to_other_hardware():
    p = profile()
    fits = ProfileFits(p, preset("qwen3-8b"), preset("qwen3-0.6b"))
    for role, shape in (("target", "qwen3-8b"), ("draft", "qwen3-0.6b")):
        on_h100 = CalibratedRoofline(fits, H200, H100, preset(shape), "p", role=role)
        assert on_h100.per_chunk
        one = on_h100.seconds("prefill", 1, 512, 0)
        assert on_h100.seconds("prefill", 4, 512, 0) == pytest.approx(4 * one)
    old = ProfileFits(profile(chunks=None), preset("qwen3-8b"), preset("qwen3-0.6b"))
    assert not CalibratedRoofline(old, H200, H100, preset("qwen3-8b"), "p").per_chunk


def test_the_key_round_trips_and_a_bad_value_is_named(tmp_path):
    assert RuntimeInfo(batch_buckets=BUCKETS).chunks == "batched"  # older profiles
    p = profile()
    p.save(tmp_path / "p.json")
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["runtime"]["chunks"] == "per_chunk"
    assert Profile.load(tmp_path / "p.json") == p
    del saved["runtime"]["chunks"]  # a file written before the key
    (tmp_path / "old.json").write_text(json.dumps(saved))
    assert Profile.load(tmp_path / "old.json").runtime.chunks == "batched"
    saved["runtime"]["chunks"] = "per_prompt"
    (tmp_path / "bad.json").write_text(json.dumps(saved, indent=1))
    with pytest.raises(ConfigError, match="runtime.chunks"):
        Profile.load(tmp_path / "bad.json")
    # parts measured by runtimes that ran chunks differently are not one profile
    with pytest.raises(ConfigError, match="runtime"):
        p.merge(profile(chunks=None))


def test_the_bundled_profiles_measured_per_chunk_say_so():
    for name in ("qwen3-8b_h200", "qwen3-8b-int4_h200", "qwen3-30b-a3b_h200"):
        assert Profile.load(BUNDLED / f"{name}.json").runtime.per_chunk, name
    assert Profile.load(BUNDLED / "qwen3-0.6b_h200.json").runtime is None  # an older file


def test_calibrate_writes_that_the_runtime_runs_per_chunk(tmp_path):
    pytest.importorskip("torch")
    from calibration.grid import Point
    from calibration.measure import Record
    from calibration.record import to_profile

    gpu = {"backend": "cupy", "graphs": True}
    fingerprint = {"device": "NVIDIA H200", "model": "qwen3-8b", "draft_model": "qwen3-0.6b",
                   "options": {"target@gpu": gpu, "draft@gpu": gpu}}
    point = Point("target", "gpu", "prefill", 2, 512, 0)
    made = to_profile([Record(point, 32.0, 7, 31.0, 33.0)], fingerprint)
    assert made.runtime.chunks == "per_chunk"
    made.save(tmp_path / "made.json")
    assert json.loads((tmp_path / "made.json").read_text())["runtime"]["chunks"] == "per_chunk"
    # priced from it: two chunks are two forwards of one
    cost = ProfileCost(Profile.load(tmp_path / "made.json"), target=preset("qwen3-8b"))
    assert cost.seconds("prefill", 4, 512, 0) == pytest.approx(4 * cost.seconds("prefill", 1, 512, 0))
