"""`kestrel calibrate` on a GPU (skipped without CUDA): qwen3-0.6b with dummy weights as
target and draft (on the GPU and the CPU) over the tiny grid, every stage measured; a decode
point, the draft's catch-up step and prompt chunk, and whole speculative rounds timed
through CUDA-graph replays captured before their runs, not eager forwards."""

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
from kestrel_rt.cuda.graphs import BUCKETS
from kestrel_sim.profile import Profile

STAGES = {"decode", "verify", "correction", "prefill", "mixed", "draft", "draft_prefill",
          "kv_transfer", "overlap", "round"}
SPEC_GRID = """\
timing: {warmup: 1, repeats: 3}
draft:
  gpu:
    batches: [4]
    contexts: [64]
    new_tokens: [1, 2]
    prefill: {batches: [1], prompts: [512], chunks: [512]}
round: {batches: [1, 8], k: [1, 4], contexts: [512]}
"""


def test_tiny_grid_on_the_gpu(tmp_path):
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", "qwen3-0.6b", "--draft",
                                      "qwen3-0.6b", "--grid", "tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    profile = Profile.load(out)
    assert profile.stages() == STAGES
    gpu = {m.stage for m in profile.measurements if m.device == "gpu"}
    cpu = {m.stage for m in profile.measurements if m.device == "cpu"}
    assert gpu == STAGES and cpu == {"draft", "draft_prefill", "kv_transfer"}
    fp = profile.fingerprint
    assert fp.device == torch.cuda.get_device_name(0)
    assert fp.cuda and fp.driver and fp.cupy and fp.backend == "cupy+graphs"
    assert fp.dtype == "bfloat16" and fp.draft_device == "gpu"
    assert profile.runtime.batch_buckets == list(BUCKETS)
    assert {(m.batch, m.tokens_per_seq) for m in profile.rows("round")} == {
        (b, k + 1) for b in (1, 4) for k in (1, 3)}


def test_decode_is_timed_on_graph_replays():
    grid, _ = load_grid("tiny")
    plan = make_plan(Request("qwen3-0.6b", grid, "tiny", "tiny", "cuda"))
    bench = build_bench(plan.benches[0], grid)
    before = bench.model.replays
    record = measure(bench, Point("target", "gpu", "decode", batch=4, m=1, context=64))
    assert bench.model.replays - before == bench.warmup + bench.repeats
    assert record.samples == bench.repeats and record.p10 <= record.ms <= record.p90


@pytest.fixture(scope="module")
def spec_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "grid.yaml"
    path.write_text(SPEC_GRID)
    grid, name = load_grid(path)
    plan = make_plan(Request("qwen3-0.6b", grid, name, str(path), "cuda", draft="qwen3-0.6b",
                             draft_device="gpu"))
    assert [b.name for b in plan.benches] == ["draft@gpu", "spec@gpu"]
    return plan


def test_draft_catch_up_and_prefill_replay_graphs_captured_at_build(spec_plan):
    grid = spec_plan.request.grid
    bench = build_bench(spec_plan.benches[0], grid)
    model = bench.model
    for point in (Point("draft", "gpu", "draft", 4, 2, 64),
                  Point("draft", "gpu", "draft_prefill", 1, 512, 0)):
        captures, replays = model.captures, model.replays
        record = measure(bench, point)
        assert model.captures == captures  # nothing captured in a point's runs
        assert model.replays - replays == bench.warmup + bench.repeats
        assert record.samples == bench.repeats and record.p10 <= record.ms <= record.p90


def test_rounds_replay_both_models_graphs(spec_plan):
    from calibration.rounds import SpecBench

    grid = spec_plan.request.grid
    spec = build_bench(spec_plan.benches[1], grid)
    assert isinstance(spec, SpecBench)
    target, draft = spec.target.model, spec.draft.model
    assert target.backend is not draft.backend
    runs = spec.target.warmup + spec.target.repeats
    for point in spec_plan.benches[1].points:
        k = point.m - 1
        before = (target.captures, draft.captures, target.replays, draft.replays)
        record = measure(spec, point)
        assert (target.captures, draft.captures) == before[:2]
        assert target.replays - before[2] == runs  # one verify per round
        assert draft.replays - before[3] == runs * k  # k one-token draft steps per round
        assert record.samples == spec.target.repeats and record.p10 <= record.ms <= record.p90

