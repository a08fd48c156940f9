"""The overlap points of the speculative decode worker's draft steps (calibration/
overlap_grid.py `draft_batches`), checked on the CPU: the default grid's points with a draft
on the GPU, the pair bench's third instance and its estimate, and the records' Profile rows
that fit the draft's own contention law (the timing: calibration/overlap.py on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from calibration.grid import expand, load_grid
from calibration.overlap import OverlapRecord, instances
from calibration.plan import Request, make_plan
from calibration.record import to_profile
from kestrel_sim.costs.profile import ProfileFits
from kestrel_sim.profile import Profile

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "tests" / "sim" / "data" / "qwen3-8b_h200_v1.json"  # draft fits, no overlap


def draft_points(devices=("gpu", "cpu")):
    grid, _ = load_grid("default")
    return [p for p in expand(grid, "gpu", devices) if p.decode_model == "draft"]


def test_the_default_grid_times_draft_steps_beside_chunks_with_a_draft_on_the_gpu():
    points = draft_points()
    assert len(points) == 12 and {p.bench for p in points} == {"pair@gpu"}
    assert all(p.stage == "overlap" and p.m == 1 for p in points)
    ids = {p.id for p in points}
    assert "pair@gpu/overlap/b4/m1/c1024/chunk2048@0/timed-draft" in ids
    assert "pair@gpu/overlap/b32/m1/c1024/chunk512@0/timed-prefill/by-draft" in ids
    assert not draft_points(("cpu",)) and not draft_points(())


def test_the_plan_builds_the_draft_beside_the_pair_within_the_budget():
    grid, _ = load_grid("default")
    plan = make_plan(Request("qwen3-8b", grid, "default", "default", "cuda",
                             draft="qwen3-0.6b"))
    pair = next(b for b in plan.benches if b.name == "pair@gpu")
    assert len(pair.points) == 36 and pair.draft.model == "qwen3-0.6b"
    assert [role for role, _, _ in instances(pair)] == ["decode", "prefill", "draft"]
    est = plan.estimate.points
    draft = est["pair@gpu/overlap/b4/m1/c1024/chunk2048@0/timed-draft"]
    target = est["pair@gpu/overlap/b4/m1/c1024/chunk2048@0/timed-decode"]
    assert 0 < draft < target  # the draft's step is shorter than the target's decode
    assert plan.estimate.seconds < 8 * 60  # issue 23: the default grid under 8 minutes
    plain = make_plan(Request("qwen3-8b", grid, "default", "default", "cuda"))
    pair = next(b for b in plain.benches if b.name == "pair@gpu")
    assert len(pair.points) == 24 and pair.draft is None
    assert [role for role, _, _ in instances(pair)] == ["decode", "prefill"]


def test_draft_records_become_rows_that_fit_the_drafts_own_law():
    grid, _ = load_grid("default")
    points = [p for p in expand(grid, "gpu", ("gpu",)) if p.stage == "overlap"]
    base = Profile.load(BUNDLED)
    fits = ProfileFits(base)
    records = []
    for p in points:
        draft = p.decode_model == "draft"
        step = ("draft" if draft else "decode" if p.m == 1 else "verify", p.batch, p.m,
                p.context)
        chunk = ("prefill", 1, p.chunk_tokens, p.chunk_context)
        mine, other = (step, chunk) if p.timed == "decode" else (chunk, step)
        alone, other_ms = fits.step_ms(*mine), fits.step_ms(*other)
        # beside the draft: a few % either side; else the target's rows slow a lot
        f = 1 + (0.02 if draft else 0.6) * (other_ms / alone) ** 0.5
        records.append(OverlapRecord(p, alone * f, 7, alone * f, alone * f, alone_ms=alone))
    rows = to_profile(records, base.fingerprint.model_dump()).rows("overlap")
    assert {(m.step_stage, m.other_stage) for m in rows} == {
        ("decode", "prefill"), ("verify", "prefill"), ("draft", "prefill"),
        ("prefill", "decode"), ("prefill", "verify"), ("prefill", "draft")}
    timed_draft = [m for m in rows if m.step_stage == "draft"]
    assert len(timed_draft) == 6 and all(m.other_tokens_per_seq in (512, 2048)
                                         for m in timed_draft)
    contention = ProfileFits(Profile(fingerprint=base.fingerprint,
                                     measurements=[*base.measurements, *rows])).contention()
    assert contention.drafts_apart and contention.law == "interleave"
    assert contention.ratio["draft"].a == pytest.approx(0.02, rel=1e-6)
    assert contention.ratio["prefill/draft"].a == pytest.approx(0.02, rel=1e-6)
    assert contention.ratio["decode"].a == pytest.approx(0.6, rel=1e-6)
    assert set(contention.held_out_by) == {"decode", "prefill", "draft", "prefill/draft"}
