"""The overlap measurement on a GPU (calibration/overlap.py): two instances of qwen3-0.6b
(dummy weights) on two streams, each side timed while the other loops beside it, through
graph replays; and `kestrel calibrate` over an overlap-only grid writing rows the simulator
fits (the fit report's overlap line)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from calibration.driver import build_bench
from calibration.grid import Point, load_grid
from calibration.measure import measure
from calibration.overlap import OverlapRecord, PairBench
from calibration.plan import Request, make_plan
from kestrel_cli.app import app
from kestrel_sim.costs.profile import ProfileFits
from kestrel_sim.profile import Profile

GRID = """\
timing: {warmup: 1, repeats: 3}
overlap:
  batches: [16]
  k: [0, 2]
  contexts: [256]
  chunks: [512]
  timed: [decode, prefill]
  served_contexts: []  # the grid's own points only (tests/test_calibrate_overlap.py plans the rest)
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("overlap") / "grid.yaml"
    path.write_text(GRID)
    grid, name = load_grid(path)
    plan = make_plan(Request("qwen3-0.6b", grid, name, str(path), "cuda"))
    assert [b.name for b in plan.benches] == ["pair@gpu"]
    bench = build_bench(plan.benches[0], grid)
    assert isinstance(bench, PairBench)
    return bench


@pytest.mark.parametrize("timed", ["decode", "prefill"])
def test_each_side_is_timed_beside_the_other_on_graph_replays(pair, timed):
    point = Point("pair", "gpu", "overlap", 16, 1, 256, 512, 0, timed=timed)
    replays = (pair.decode.model.replays, pair.prefill.model.replays)
    record = measure(pair, point)
    assert isinstance(record, OverlapRecord)
    assert record.samples == pair.decode.repeats
    assert record.p10 <= record.ms <= record.p90 and record.alone_ms > 0
    # beside a step of the other worker it is never much faster than alone
    assert record.ms > 0.9 * record.alone_ms
    # both instances ran graph replays: the timed one alone and beside, the other looping
    assert pair.decode.model.replays > replays[0] and pair.prefill.model.replays > replays[1]
    assert all(pair.decode.model.kv.length(s) == 0 for s in pair.decode.slots)
    torch.cuda.synchronize()


def test_calibrate_writes_overlap_rows_the_simulator_fits(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(GRID)
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", "qwen3-0.6b", "--grid",
                                      str(grid), "--out", str(out)])
    assert result.exit_code == 0, result.output
    profile = Profile.load(out)
    rows = profile.rows("overlap")
    assert len(rows) == 4 and profile.stages() == {"overlap"}
    assert {m.step_stage for m in rows} == {"decode", "verify", "prefill"}
    assert all(m.alone_ms > 0 and m.slowdown > 0.9 for m in rows)
    print("\n".join(f"{m.step_stage} b{m.batch} m{m.tokens_per_seq} beside {m.other_stage} "
                    f"b{m.other_batch} m{m.other_tokens_per_seq}: {m.alone_ms:.3f} -> "
                    f"{m.ms:.3f} ms (x{m.slowdown:.2f})" for m in rows))
    # an overlap-only profile has no stage fits to split its steps with: the simulator
    # needs the decode, verify and prefill rows beside them (the default grid has them)
    assert ProfileFits(profile).overlap_rows() == []


def test_calibrate_times_the_drafts_steps_beside_a_chunk(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(GRID + "  draft_batches: [16]\n")
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", "qwen3-0.6b", "--draft",
                                      "qwen3-0.6b", "--draft-device", "gpu", "--grid",
                                      str(grid), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = Profile.load(out).rows("overlap")
    drafted = [m for m in rows if "draft" in (m.step_stage, m.other_stage)]
    assert len(rows) == 6 and len(drafted) == 2
    assert {(m.step_stage, m.other_stage) for m in drafted} == {("draft", "prefill"),
                                                                ("prefill", "draft")}
    assert all(m.alone_ms > 0 and m.slowdown > 0.9 for m in drafted)
    print("\n".join(f"{m.step_stage} beside {m.other_stage}: {m.alone_ms:.3f} -> "
                    f"{m.ms:.3f} ms (x{m.slowdown:.2f})" for m in drafted))
