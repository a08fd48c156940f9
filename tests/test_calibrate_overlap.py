"""The overlap measurement of `kestrel calibrate` on the CPU, where it can be checked without a
GPU: the grid section and its points (GPU runs only), the pair bench in the plan and its
estimate, the instances' KV layout, the loop's length, and the records' Profile rows that
the simulator fits (the timing itself: tests/gpu/test_calibrate_overlap_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from calibration.grid import Point, expand, load_grid
from calibration.overlap import OverlapRecord, layout, loop_length
from calibration.overlap_grid import COVER
from calibration.plan import Request, make_plan
from calibration.record import to_profile
from kestrel_sim.costs.profile import ProfileFits
from kestrel_sim.errors import ConfigError
from kestrel_sim.profile import Profile

ROOT = Path(__file__).resolve().parents[1]
# a profile without overlap rows (the 2026-12-01 hand-made one): the test adds its own
BUNDLED = ROOT / "tests" / "sim" / "data" / "qwen3-8b_h200_v1.json"


def pair_points(name: str = "default") -> list[Point]:
    grid, _ = load_grid(name)
    return [p for p in expand(grid, "gpu") if p.stage == "overlap"]


def test_the_default_grid_times_each_side_beside_the_other_on_a_gpu_only():
    points = pair_points()
    assert len(points) == 24 and {p.bench for p in points} == {"pair@gpu"}
    ids = {p.id for p in points}
    assert "pair@gpu/overlap/b32/m5/c1024/chunk2048@0/timed-decode" in ids
    # and the decode side as served (overlap_grid.py served_*): small batches at 2048
    assert "pair@gpu/overlap/b1/m1/c2048/chunk2048@0/timed-prefill" in ids
    assert "pair@gpu/overlap/b4/m1/c1024/chunk512@0/timed-prefill" in ids
    grid, _ = load_grid("default")
    assert not [p for p in expand(grid, "cpu") if p.stage == "overlap"]


@pytest.mark.parametrize("text, key, what", [
    ("overlap: {batches: [4], k: [16], contexts: [8], chunks: [8]}\n", "overlap.k",
     "at most 15"),
    ("overlap: {batches: [], contexts: [8], chunks: [8]}\n", "overlap.batches", "at least one"),
    ("overlap: {batches: [4], contexts: [8], chunks: [8], timed: [draft]}\n", "overlap.timed",
     "decode"),
])
def test_bad_overlap_sections_are_named(tmp_path, text, key, what):
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_grid(path)
    assert f"{path}:1: {key}" in str(err.value) and what in str(err.value)


def test_the_plan_has_a_pair_bench_of_two_builds():
    grid, _ = load_grid("default")
    plan = make_plan(Request("qwen3-8b", grid, "default", "default", "cuda"))
    pair = [b for b in plan.benches if b.name == "pair@gpu"]
    assert len(pair) == 1 and len(pair[0].points) == 24
    target = plan.estimate.builds["target@gpu"] - plan.estimate.compile
    # two instances: one more model's weights to make (fast on a GPU: the H200 built
    # qwen3-30b-a3b's target in 4.6 s and its pair in 5.2 s)
    assert plan.estimate.builds["pair@gpu"] > target
    # each point: the timed step alone, then beside a loop of COVER x its time
    timed_prefill = plan.estimate.points["pair@gpu/overlap/b4/m1/c1024/chunk2048@0/timed-prefill"]
    timed_decode = plan.estimate.points["pair@gpu/overlap/b4/m1/c1024/chunk2048@0/timed-decode"]
    assert timed_prefill > timed_decode
    assert plan.estimate.seconds < 8 * 60  # issue 23: the default grid under 8 minutes
    cpu = make_plan(Request("qwen3-8b", grid, "default", "default", "cpu"))
    assert "pair@gpu" not in {b.name for b in cpu.benches}


def test_each_instance_is_laid_out_for_its_side():
    points = pair_points()
    decode = layout(points, "decode", ())
    assert decode["batches"] == (1, 4, 8, 32) and decode["new_tokens"] == (1, 5)
    assert decode["slots"] == 64 and decode["max_len"] == 2048 + 5 + 1
    prefill = layout(points, "prefill", (512, 768, 2048, 3072))
    assert prefill["prefill"] == (512, 2048) and prefill["slots"] == 2
    assert prefill["max_len"] == 2048 + 1


def test_the_loop_outlasts_the_timed_step():
    assert loop_length(alone_ms=50.0, other_ms=5.0) == 1 + 30
    assert loop_length(alone_ms=5.0, other_ms=50.0) == 2  # one before, one beside at least
    for alone, other in ((7.0, 47.0), (47.0, 7.0), (1.0, 1.0)):
        assert (loop_length(alone, other) - 1) * other >= COVER * alone


def test_records_become_overlap_rows_the_simulator_fits():
    fingerprint = Profile.load(BUNDLED).fingerprint.model_dump()
    records = []
    for p in pair_points():
        alone = 10.0
        slowdown = 1.3 if p.timed == "decode" else 1.1
        records.append(OverlapRecord(p, alone * slowdown, 7, alone * slowdown * 0.99,
                                     alone * slowdown * 1.01, alone_ms=alone))
    profile = to_profile(records, fingerprint)
    rows = profile.rows("overlap")
    assert len(rows) == 24
    verify = [m for m in rows if m.step_stage == "verify"]
    assert verify and all(m.tokens_per_seq == 5 and m.other_stage == "prefill"
                          and m.other_batch == 1 for m in verify)
    chunk = [m for m in rows if m.step_stage == "prefill"]
    assert {m.tokens_per_seq for m in chunk} == {512, 2048}
    assert {m.other_stage for m in chunk} == {"decode", "verify"}
    assert all(m.slowdown == pytest.approx(1.1) for m in chunk)
    merged = Profile(fingerprint=profile.fingerprint,
                     measurements=[*Profile.load(BUNDLED).measurements, *rows])
    fitted = ProfileFits(merged).contention()
    assert fitted.rows == 24 and 0.0 <= fitted.serial["decode"] <= 1.0
