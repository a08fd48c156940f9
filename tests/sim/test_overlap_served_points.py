"""The overlap grid's served points (calibration/overlap_grid.py `served_*`): the decode side
at the shapes the disaggregated scenarios serve on one GPU (small batches at ~2k contexts)
beside the largest chunk, each side timed, added to the grid's own points by default; and
the default grid with a draft still measured in under 8 minutes (issue 23)."""

from __future__ import annotations

import pytest

from calibration.overlap_grid import OverlapGrid

GRID = {"batches": [4, 32], "k": [0, 4], "contexts": [1024], "chunks": [512, 2048],
        "draft_batches": [4, 32]}


def test_the_served_points_come_by_default_beside_the_largest_chunk():
    grid = OverlapGrid(**GRID)
    shapes = grid.shapes()
    served = [s for s in shapes if s[3] == 2048]
    # decode and verify (k 0, 4) of batches 1 and 8, each side timed, beside chunk 2048
    assert sorted(served) == sorted((t, b, m, 2048, 2048, 0) for t in ("decode", "prefill")
                                    for b in (1, 8) for m in (1, 5))
    assert len(shapes) == 16 + 8
    drafts = [s for s in grid.draft_shapes() if s[2] == 2048]
    assert sorted(drafts) == sorted((t, b, 2048, 2048, 0) for t in ("decode", "prefill")
                                    for b in (1, 8))


def test_served_points_can_be_turned_off_and_repeat_none_of_the_grids():
    off = OverlapGrid(**GRID, served_contexts=[])
    assert len(off.shapes()) == 16 and len(off.draft_shapes()) == 8
    # a served shape the grid has already: measured once
    same = OverlapGrid(**GRID, served_contexts=[1024], served_batches=[4])
    assert len(same.shapes()) == len(set(same.shapes())) == 16
    # no draft points in the grid: no served draft points either
    plain = OverlapGrid(**{**GRID, "draft_batches": []})
    assert plain.draft_shapes() == []
    with pytest.raises(ValueError):
        OverlapGrid(**GRID, served_batches=[0])


def test_the_default_grid_with_its_served_points_stays_under_eight_minutes():
    pytest.importorskip("torch")
    from calibration.grid import load_grid
    from calibration.plan import Request, make_plan

    grid, _ = load_grid("default")
    plan = make_plan(Request("qwen3-8b", grid, "default", "default", "cuda",
                             draft="qwen3-0.6b"))
    ids = set(plan.estimate.points)
    assert "pair@gpu/overlap/b1/m1/c2048/chunk2048@0/timed-draft" in ids
    assert "pair@gpu/overlap/b8/m5/c2048/chunk2048@0/timed-prefill" in ids
    assert plan.estimate.seconds < 8 * 60
