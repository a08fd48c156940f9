"""`kestrel calibrate` on a GPU (skipped without CUDA): qwen3-0.6b with dummy weights as
target and draft (on the GPU and the CPU) over the tiny grid, every stage measured; and a
decode point timed through CUDA-graph replays, not eager forwards."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

from typer.testing import CliRunner

from calibration.driver import build_bench
from calibration.grid import Point, load_grid
from calibration.measure import measure
from calibration.plan import Request, make_plan
from kestrel_cli.app import app
from kestrel_sim.profile import Profile

STAGES = {"decode", "verify", "correction", "prefill", "mixed", "draft", "kv_transfer",
          "overlap"}


def test_tiny_grid_on_the_gpu(tmp_path):
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", "qwen3-0.6b", "--draft",
                                      "qwen3-0.6b", "--grid", "tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    profile = Profile.load(out)
    assert profile.stages() == STAGES
    gpu = {m.stage for m in profile.measurements if m.device == "gpu"}
    cpu = {m.stage for m in profile.measurements if m.device == "cpu"}
    assert gpu == STAGES and cpu == {"draft", "kv_transfer"}
    fp = profile.fingerprint
    assert fp.device == torch.cuda.get_device_name(0)
    assert fp.cuda and fp.driver and fp.cupy and fp.backend == "cupy+graphs"
    assert fp.dtype == "bfloat16" and fp.draft_device == "gpu"


def test_decode_is_timed_on_graph_replays():
    grid, _ = load_grid("tiny")
    plan = make_plan(Request("qwen3-0.6b", grid, "tiny", "tiny", "cuda"))
    bench = build_bench(plan.benches[0], grid)
    before = bench.model.replays
    record = measure(bench, Point("target", "gpu", "decode", batch=4, m=1, context=64))
    assert bench.model.replays - before == bench.warmup + bench.repeats
    assert record.samples == bench.repeats and record.p10 <= record.ms <= record.p90
