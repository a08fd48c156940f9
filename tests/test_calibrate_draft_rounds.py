"""The CPU draft's steps timed inside speculative rounds (grid `draft.cpu.timed: in_rounds`,
calibration/draft_rounds.py), on the CPU with tiny models: the grid makes them points of the
bench spec@cpu, each run is a round whose first draft step is the point's, the record takes
the steps the docstring says, the plan builds the target beside the draft and estimates it,
and the rows land in a Profile as the draft's CPU rows."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_models

from calibration.driver import fingerprint
from calibration.grid import CpuDraftSteps, DraftGrid, Grid, Point, expand, load_grid
from calibration.measure import measure
from calibration.plan import Request, make_plan
from calibration.record import to_measurement
from calibration.round_grid import DRAFT_ROUND_K
from calibration.rounds import build_spec
from kestrel_sim.errors import ConfigError


def timed(how: str, name: str = "default"):
    """The bundled grid `name` with its CPU draft's steps timed `how` (the default grid's
    are timed in rounds)."""
    grid, _ = load_grid(name)
    cpu = grid.draft.cpu.model_copy(update={"timed": how})
    return grid.model_copy(update={"draft": grid.draft.model_copy(update={"cpu": cpu})})


def in_rounds(name: str = "default"):
    return timed("in_rounds", name)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: tiny_models.build(name, tmp_path_factory.mktemp(name))
            for name in ("tied", "untied")}


def spy_on(model, monkeypatch) -> list:
    """Record each forward: (tokens shape, n_new, last_only, cache lengths before)."""
    seen, forward = [], model.forward

    def spy(tokens, slots, n_new=None, last_only=False, greedy=False):
        seen.append((tuple(tokens.shape), n_new, last_only,
                     [model.kv.length(s) for s in slots]))
        return forward(tokens, slots, n_new, last_only, greedy)

    monkeypatch.setattr(model, "forward", spy)
    return seen


# -- the grid ------------------------------------------------------------------------------
def test_steps_in_rounds_are_points_of_the_bench_spec_at_cpu():
    alone = expand(timed("alone"), "gpu", ("gpu", "cpu"))
    rounds = expand(in_rounds(), "gpu", ("gpu", "cpu"))
    steps = [p for p in alone if p.bench == "draft@cpu" and p.stage == "draft"]
    spec = [p for p in rounds if p.bench == "spec@cpu"]
    assert len(steps) == 18 and [(p.batch, p.m, p.context) for p in spec] == [
        (p.batch, p.m, p.context) for p in steps]  # the same shapes, timed in rounds
    assert all(p.stage == "draft" and p.device == "cpu" for p in spec)
    assert spec[0].id == "spec@cpu/draft/b1/m1/c128"
    assert spec[-1].reach == 1024 + 2 + DRAFT_ROUND_K  # and the round's later steps
    # the draft's prompt pass stays timed alone; the GPU draft's steps are not affected
    assert [p.stage for p in rounds if p.bench == "draft@cpu"] == ["draft_prefill"] + [
        "kv_transfer"] * 4
    assert ([p.id for p in rounds if p.bench == "draft@gpu"]
            == [p.id for p in alone if p.bench == "draft@gpu"])


def test_only_the_cpu_draft_is_timed_in_rounds(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("draft:\n  gpu: {batches: [1], contexts: [8], timed: in_rounds}\n")
    with pytest.raises(ConfigError, match="timed"):
        load_grid(path)
    path.write_text("draft:\n  cpu: {batches: [1], contexts: [8], timed: served}\n")
    with pytest.raises(ConfigError, match="timed"):
        load_grid(path)
    assert load_grid("default")[0].draft.cpu.timed == "in_rounds"  # as serving runs them
    assert load_grid("quick")[0].draft.cpu.timed == "alone"


# -- the measurement -----------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 2])
def test_a_point_is_the_first_draft_step_of_each_round(folders, monkeypatch, m):
    grid = in_rounds("tiny")
    point = Point("spec", "cpu", "draft", 2, m, 40)
    spec = build_spec(tiny_models.spec_plan(folders, [point, Point("spec", "cpu", "draft", 3, 1, 64)]),
                      grid)
    target = spy_on(spec.target.model, monkeypatch)
    draft = spy_on(spec.draft.model, monkeypatch)
    record = measure(spec, point)
    t = grid.timing
    runs, k = t.cpu_warmup + t.cpu_repeats, DRAFT_ROUND_K
    # a one-token point takes every draft step of its rounds, a catch-up point its first
    assert record.samples == t.cpu_repeats * (k if m == 1 else 1)
    assert record.point == point and record.p10 <= record.ms <= record.p90
    first = ((2, 1), None, False, [40, 40]) if m == 1 else ((2, 2), [2, 2], True, [40, 40])
    later = [((2, 1), None, False, [40 + m + i] * 2) for i in range(k - 1)]
    assert draft == ([first] + later) * runs  # the draft M tokens behind, then one each
    # between one run's draft steps and the next's, the target's verify of k + 1 tokens
    assert target == [((2, k + 1), [k + 1] * 2, False, [40 + m - 1] * 2)] * runs
    assert len(spec.tracer.spans) == 0  # collected: a run's spans do not pile up
    for bench in (spec.target, spec.draft):
        assert all(bench.model.kv.length(s) == 0 for s in bench.slots)  # left empty


def test_its_record_is_a_cpu_draft_row_of_the_profile(folders):
    point = Point("spec", "cpu", "draft", 1, 2, 16)
    spec = build_spec(tiny_models.spec_plan(folders, [point]), in_rounds("tiny"))
    row = to_measurement(measure(spec, point))
    assert (row.stage, row.device, row.batch, row.tokens_per_seq, row.context) == (
        "draft", "cpu", 1, 2, 16)
    assert row.ms > 0 and row.samples == 3


# -- the plan ------------------------------------------------------------------------------
def test_the_plan_builds_the_target_beside_its_cpu_draft():
    grid = in_rounds()
    plan = make_plan(Request("qwen3-8b", grid, "default", "default", "cuda",
                             draft="qwen3-0.6b"))
    spec = next(b for b in plan.benches if b.name == "spec@cpu")
    assert (spec.model, spec.device, spec.draft.name, spec.draft.device) == (
        "qwen3-8b", "cuda", "draft@cpu", "cpu")
    assert len(spec.points) == 18 and not spec.draft.points
    est = plan.estimate
    alone = make_plan(Request("qwen3-8b", timed("alone"), "default", "default",
                              "cuda", draft="qwen3-0.6b")).estimate
    assert est.builds["spec@cpu"] > 0 and "spec@cpu" not in alone.builds
    # a round costs more than its step, a catch-up point more than a one-token one
    assert (est.points["spec@cpu/draft/b4/m2/c1024"] > est.points["spec@cpu/draft/b4/m1/c1024"]
            > alone.points["draft@cpu/draft/b4/m1/c1024"])
    assert est.seconds < 8 * 60  # issue 23: the default grid under 8 minutes


def test_a_grid_of_steps_in_rounds_alone_fingerprints_its_draft(folders, tmp_path):
    path = tmp_path / "draft-cpu-rounds.yaml"  # the grid the lead's H200 step uses
    path.write_text("draft:\n  cpu: {batches: [1, 2, 4], contexts: [128, 512, 1024], "
                    "new_tokens: [1, 2], timed: in_rounds}\n")
    grid, name = load_grid(path)
    plan = make_plan(Request("qwen3-8b", grid, name, str(path), "cuda", draft="qwen3-0.6b",
                             draft_device="cpu"))
    assert [(b.name, len(b.points)) for b in plan.benches] == [("spec@cpu", 18)]
    steps = CpuDraftSteps(batches=[1, 2], contexts=[8], timed="in_rounds")
    plan = make_plan(Request(str(folders["tied"]), Grid(draft=DraftGrid(cpu=steps)), "g",
                             "g", "cpu", draft=str(folders["untied"])))
    assert [b.name for b in plan.benches] == ["spec@cpu"]
    fp = fingerprint(plan)
    # the draft bench measured nothing alone, but the profile still says where it ran
    assert fp["draft_device"] == "cpu" and fp["draft_shape_hash"]
    assert set(fp["options"]) == {"spec@cpu", "draft@cpu"}
