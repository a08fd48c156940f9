"""`kestrel calibrate` on the CPU: a tiny model and grid end to end into a Profile that
validates, the fingerprint filled, a failing point named while the others are kept, a bad
grid an exit-2 error, the time estimate and budget, and what one measured point runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_models
from typer.testing import CliRunner

import calibration.measure
from calibration.grid import Point, expand, load_grid
from calibration.measure import Bench, measure, transfer_caches
from calibration.plan import Request, fit_budget, make_plan
from kestrel_cli.app import app
from kestrel_rt.loading import resolve
from kestrel_rt.runner import build_model, prepare
from kestrel_sim.costs.shape import shape_hash
from kestrel_sim.errors import ConfigError, KestrelError
from kestrel_sim.profile import Profile

runner = CliRunner()
STAGES = {"decode", "verify", "correction", "prefill", "mixed", "draft", "draft_prefill",
          "kv_transfer"}


def invoke(*args: str):
    return runner.invoke(app, ["calibrate", *args])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: tiny_models.build(name, tmp_path_factory.mktemp(name))
            for name in ("tied", "untied")}


@pytest.fixture(scope="module")
def calibrated(folders, tmp_path_factory):
    """The tiny grid, target and draft on the CPU: (CliRunner result, profile path)."""
    out = tmp_path_factory.mktemp("calibrated") / "profile.json"
    result = invoke("--model", str(folders["tied"]), "--draft", str(folders["untied"]),
                    "--device", "cpu", "--grid", "tiny", "--commit", "abc123", "--out", str(out))
    return result, out


def test_tiny_grid_end_to_end_writes_a_valid_profile(calibrated):
    result, out = calibrated
    assert result.exit_code == 0, result.output
    profile = Profile.load(out)  # schema-checked
    assert json.loads(out.read_text())["schema_version"] == 2
    grid, _ = load_grid("tiny")
    points = expand(grid, "cpu", ("cpu",))
    assert len(profile.measurements) == len(points)
    assert profile.stages() == STAGES
    keys = {(m.stage, m.batch, m.tokens_per_seq, m.context, m.chunk_tokens, m.chunk_context)
            for m in profile.measurements}
    for p in points:  # every point is a row with its own shape
        chunk = (p.chunk_tokens, p.chunk_context) if p.stage == "mixed" else (None, None)
        assert (p.stage, p.batch, p.m, p.context, *chunk) in keys
    for m in profile.measurements:
        assert m.device == "cpu"
        assert m.samples == grid.timing.cpu_repeats
        assert m.p10 <= m.ms <= m.p90
    # the draft's catch-up steps (M = 2) and its prompt chunks, as serving runs them
    draft = profile.rows("draft", "cpu")
    assert {m.tokens_per_seq for m in draft} == {1, 2}
    assert {(m.batch, m.tokens_per_seq, m.context) for m in profile.rows("draft_prefill", "cpu")
            } == {(1, 16, 0), (1, 16, 16), (1, 16, 32), (1, 48, 0)}
    # whole rounds need the target and the draft on a GPU: left out, with a note
    assert "round points are skipped" in result.output
    # the torch backend pads no step to a graph's batch, and runs a forward per prompt chunk
    assert profile.runtime.batch_buckets == [] and not profile.runtime.graphs
    assert profile.runtime.prefill_buckets is None and profile.runtime.chunks == "per_chunk"
    assert profile.runtime.bucket(3, 1) == 3
    shape, _ = resolve(profile.fingerprint.model)
    for m in profile.rows("kv_transfer", "cpu"):
        # float32 K and V of every layer, for one model or the other
        assert m.bytes % (m.tokens_per_seq * 4) == 0
    target = [m for m in profile.rows("kv_transfer", "cpu")
              if m.bytes == m.tokens_per_seq * shape.kv_elements_per_token * 4]
    assert len(target) == len(grid.kv_transfer.tokens)


def test_fingerprint_is_filled(calibrated, folders):
    _, out = calibrated
    fp = Profile.load(out).fingerprint
    target, _ = resolve(folders["tied"])
    draft, _ = resolve(folders["untied"])
    assert fp.model == str(folders["tied"].resolve())
    assert fp.model_shape_hash == shape_hash(target)
    assert fp.draft_model == str(folders["untied"].resolve())
    assert fp.draft_shape_hash == shape_hash(draft)
    assert fp.draft_device == "cpu"
    assert fp.git_commit == "abc123"
    assert fp.torch == torch.__version__
    assert fp.device and fp.host_cpu and fp.date
    assert (fp.dtype, fp.quant, fp.backend, fp.grid) == ("float32", "none", "torch", "tiny")
    assert set(fp.options) == {"target@cpu", "draft@cpu"}
    assert fp.options["target@cpu"]["backend"] == "torch"
    assert fp.options["draft@cpu"]["dtype"] == "float32"


def test_a_failing_point_is_named_and_the_others_kept(folders, tmp_path, monkeypatch):
    grid = tmp_path / "g.yaml"
    grid.write_text("timing: {cpu_warmup: 1, cpu_repeats: 1}\n"
                    "decode: {batches: [1, 2], contexts: [8]}\n"
                    "mixed: {batches: [2], k: [0], contexts: [8], chunks: [8], "
                    "chunk_contexts: [0, 16]}\n")
    real = calibration.measure.measure_mixed

    def flaky(bench, point):
        if point.chunk_context == 16:
            raise RuntimeError("boom in the packed forward")
        return real(bench, point)

    monkeypatch.setattr(calibration.measure, "measure_mixed", flaky)
    out = tmp_path / "p.json"
    result = invoke("--model", str(folders["tied"]), "--device", "cpu", "--grid", str(grid),
                    "--out", str(out))
    assert result.exit_code == 1
    assert "target@cpu/mixed/b2/m1/c8/chunk8@16" in result.output
    assert "RuntimeError: boom in the packed forward" in result.output
    profile = Profile.load(out)
    got = sorted((m.stage, m.batch, m.chunk_context) for m in profile.measurements)
    assert got == [("decode", 1, None), ("decode", 2, None), ("mixed", 2, 0)]


def test_bad_grid_exits_2_naming_file_line_and_key(tmp_path):
    grid = tmp_path / "bad.yaml"
    grid.write_text("decode:\n  batches: [1, -4]\n  contexts: [8]\n")
    done = subprocess.run([sys.executable, "-m", "kestrel_cli.app", "calibrate", "--model",
                           "qwen3-0.6b", "--grid", str(grid), "--out", str(tmp_path / "p.json")],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{grid}:2: decode.batches: every batch must be >= 1" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "p.json").exists()


def test_dry_run_prints_the_plan_and_estimate(folders):
    result = invoke("--model", str(folders["tied"]), "--draft", str(folders["untied"]),
                    "--device", "cpu", "--grid", "tiny", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "estimated about" in result.output
    assert "target@cpu/verify/b2/m4/c32\t" in result.output


def test_draft_on_the_gpu_needs_the_target_on_a_gpu(folders):
    with pytest.raises(KestrelError, match="--draft-device gpu needs the target on a GPU"):
        make_plan(Request(str(folders["tied"]), load_grid("tiny")[0], "tiny", "tiny", "cpu",
                          draft=str(folders["untied"]), draft_device="gpu"))


def test_a_grid_past_the_model_context_is_refused(folders, tmp_path):
    grid = tmp_path / "long.yaml"
    grid.write_text("decode: {batches: [1], contexts: [1000]}\n")  # tiny context: 256
    with pytest.raises(ConfigError, match=r"point target@cpu/decode/b1/m1/c1000 reaches 1001"):
        make_plan(Request(str(folders["tied"]), load_grid(grid)[0], "long", str(grid), "cpu"))


# -- the estimate -------------------------------------------------------------------------
def default_plan(grid: str = "default"):
    g, name = load_grid(grid)
    return make_plan(Request("qwen3-8b", g, name, grid, "cuda", draft="qwen3-0.6b"))


def test_default_grid_is_estimated_under_8_minutes_on_an_h200():
    plan = default_plan()
    assert [b.name for b in plan.benches] == ["target@gpu", "draft@gpu", "draft@cpu",
                                              "pair@gpu", "spec@gpu", "spec@cpu"]
    assert plan.estimate.seconds < 8 * 60
    assert default_plan("quick").estimate.seconds < plan.estimate.seconds
    # long steps weigh more: a batch-4 2048-token prefill chunk against a batch-1 decode
    est = plan.estimate.points
    assert est["target@gpu/prefill/b4/m2048/c2048"] > 10 * est["target@gpu/decode/b1/m1/c128"]


def test_long_points_are_estimated_with_their_rests():
    """A GPU point whose runs take REST_FROM_MS or more idles as long after each run
    (calibration/measure.py timed): its estimate doubles; a short point's does not."""
    from calibration.estimate import GPU, point_seconds, step_seconds
    from calibration.grid import Point
    from calibration.measure import REST_FROM_MS
    from kestrel_sim.models import preset

    shape = preset("qwen3-8b")
    long = Point("target", "gpu", "prefill", batch=4, m=2048, context=2048)
    short = Point("target", "gpu", "decode", batch=1, m=1, context=128)
    for p, rests in ((long, True), (short, False)):
        graphed = p.m <= 16  # as point_seconds decides (b <= 64)
        step = step_seconds(shape, GPU, 2, None, p.batch, p.m, p.context, graphed)
        assert (step * 1e3 >= REST_FROM_MS) is rests
        want = 9 * step * (2 if rests else 1) + GPU.point_s
        assert point_seconds(p, shape, GPU, 2, None, 9) == pytest.approx(want)


def test_a_budget_thins_the_repeats_or_is_refused():
    plan = default_plan()
    minutes = plan.estimate.seconds / 60 * 0.8
    thinned = fit_budget(plan, minutes)
    t = thinned.request.grid.timing
    assert thinned.estimate.seconds <= minutes * 60
    assert 3 <= t.repeats < plan.request.grid.timing.repeats
    assert fit_budget(plan, 100) is plan
    with pytest.raises(ConfigError, match="over the --max-minutes budget of 0.5"):
        fit_budget(plan, 0.5)


# -- one point ----------------------------------------------------------------------------
@pytest.fixture()
def bench(folders):
    model = build_model(folders["tied"], "cpu", seed=0)
    prepare(model, 6, 128)
    return Bench("target@cpu", model, [model.kv.allocate() for _ in range(6)], 1, 3)


def test_a_point_runs_at_its_context_on_rotating_slots(bench, monkeypatch):
    seen = []
    forward = bench.model.forward

    def spy(tokens, slots, *args, **kwargs):
        seen.append((tuple(tokens.shape), tuple(slots),
                     [bench.model.kv.length(s) for s in slots]))
        return forward(tokens, slots, *args, **kwargs)

    monkeypatch.setattr(bench.model, "forward", spy)
    record = measure(bench, Point("target", "cpu", "verify", batch=2, m=4, context=40))
    assert record.samples == 3 and record.ms > 0
    assert len(seen) == 4  # one warm-up, three timed
    assert all(shape == (2, 4) and lengths == [40, 40] for shape, _, lengths in seen)
    assert len({slots for _, slots, _ in seen}) == 3  # six slots, two rows: three windows
    assert all(bench.model.kv.length(s) == 0 for s in bench.slots)  # left empty

    seen.clear()
    measure(bench, Point("target", "cpu", "correction", batch=1, m=1, context=30, after_k=3))
    # the untimed verify of k + 1 tokens, then the correction, both at the context
    assert [(shape, lengths) for shape, _, lengths in seen[:2]] == [((1, 4), [30]),
                                                                   ((1, 1), [30])]


def test_kv_transfer_copies_the_rows(bench):
    bench.transfers[""] = transfer_caches(bench.model, 64)
    src, dst = bench.transfers[""]
    src.k.normal_()
    src.v.normal_()
    record = measure(bench, Point("target", "cpu", "kv_transfer", m=48))
    assert record.bytes == 48 * bench.model.shape.kv_elements_per_token * 4
    assert record.link == "cpu->cpu"  # within the device
    assert torch.equal(dst.k[:, 0, :48], src.k[:, 0, :48])
    assert torch.equal(dst.v[:, 0, :48], src.v[:, 0, :48])
    assert not dst.k[:, 0, 48:].any()



def test_a_spent_budget_skips_the_rest_without_building(folders, monkeypatch):
    from calibration import driver

    def no_build(*args):
        raise AssertionError("built a bench after the budget was spent")

    monkeypatch.setattr(driver, "build_bench", no_build)
    plan = make_plan(Request(str(folders["tied"]), load_grid("tiny")[0], "tiny", "tiny", "cpu",
                             draft=str(folders["untied"])))
    outcome = driver.run(plan, driver.Silent(), max_minutes=1e-9)
    assert outcome.records == []
    assert set(outcome.failures) == {p.id for p in plan.points}
    assert set(outcome.failures.values()) == {driver.SKIPPED}
