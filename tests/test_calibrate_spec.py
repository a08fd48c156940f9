"""What `kestrel calibrate` measures of speculative decoding besides its steps, on the CPU with
tiny models: the draft's catch-up step (M > 1) and prompt chunks run as serving runs them,
whole rounds (calibration/rounds.py, measured on a GPU by the plan, but working on any
device), the round bench in the plan and its estimate, and the Profile's runtime (the batch
buckets of the runtime's step graphs)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_models

from calibration.driver import warm_catch_up
from calibration.grid import Point, load_grid
from calibration.measure import Bench, Record, measure
from calibration.plan import Request, make_plan
from calibration.record import runtime_info, to_profile
from calibration.rounds import build_spec, measure_round
from kestrel_rt.runner import build_model, prepare
from kestrel_sim.runtime_info import RuntimeInfo

FINGERPRINT = {"device": "NVIDIA H200", "model": "qwen3-8b", "draft_model": "qwen3-0.6b"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: tiny_models.build(name, tmp_path_factory.mktemp(name))
            for name in ("tied", "untied")}


@pytest.fixture()
def draft_bench(folders):
    model = build_model(folders["untied"], "cpu", seed=0)
    prepare(model, 4, 128)
    return Bench("draft@cpu", model, [model.kv.allocate() for _ in range(4)], 1, 2)


def spy_on(model, monkeypatch) -> list:
    """Record each forward: (tokens shape, n_new, last_only, cache lengths before)."""
    seen, forward = [], model.forward

    def spy(tokens, slots, n_new=None, last_only=False, greedy=False):
        seen.append((tuple(tokens.shape), n_new, last_only,
                     [model.kv.length(s) for s in slots]))
        assert greedy  # every step calibration times is greedy, as serving's
        return forward(tokens, slots, n_new, last_only, greedy)

    monkeypatch.setattr(model, "forward", spy)
    return seen


# -- the draft ----------------------------------------------------------------------------
def test_a_draft_step_of_two_tokens_is_a_rounds_catch_up_step(draft_bench, monkeypatch):
    seen = spy_on(draft_bench.model, monkeypatch)
    record = measure(draft_bench, Point("draft", "cpu", "draft", batch=2, m=2, context=20))
    assert record.samples == 2
    # serving's first draft step: the tokens not yet cached, the last one's choice only
    assert seen == [((2, 2), [2, 2], True, [20, 20])] * 3
    seen.clear()
    measure(draft_bench, Point("draft", "cpu", "draft", batch=2, m=1, context=20))
    assert seen == [((2, 1), None, False, [20, 20])] * 3  # a plain one-token step


def test_a_draft_prefill_point_runs_each_chunk_alone(draft_bench, monkeypatch):
    seen = spy_on(draft_bench.model, monkeypatch)
    record = measure(draft_bench, Point("draft", "cpu", "draft_prefill", batch=2, m=16,
                                        context=16))
    assert record.samples == 2 and record.p10 <= record.ms <= record.p90
    assert seen == [((1, 16), None, True, [16])] * 6  # 3 runs x 2 chunks, one forward each
    assert all(draft_bench.model.kv.length(s) == 0 for s in draft_bench.slots)


def test_catch_up_graphs_are_captured_when_the_bench_is_built(draft_bench, monkeypatch):
    seen = spy_on(draft_bench.model, monkeypatch)
    warm_catch_up(draft_bench, [Point("draft", "cpu", "draft", 2, 2, 64)])
    assert seen == []  # an eager model has no graph to capture
    monkeypatch.setattr(draft_bench.model, "graphs", {}, raising=False)  # as a GraphModel
    points = [Point("draft", "cpu", "draft", b, 2, c) for b in (1, 2) for c in (8, 64)]
    warm_catch_up(draft_bench, points)
    # one forward per shape as the points run it (a graph per batch x M x last_only)
    assert seen == [((1, 2), [2], True, [0]), ((2, 2), [2, 2], True, [0, 0])]
    assert all(draft_bench.model.kv.length(s) == 0 for s in draft_bench.slots)


# -- whole rounds -------------------------------------------------------------------------
def test_a_round_rejects_every_proposal_and_starts_alike_each_run(folders, monkeypatch):
    points = [Point("spec", "cpu", "round", 3, 4, 40), Point("spec", "cpu", "round", 1, 2, 8)]
    grid, _ = load_grid("tiny")
    spec = build_spec(tiny_models.spec_plan(folders, points), grid)
    assert spec.target.model.backend is not spec.draft.model.backend
    target = spy_on(spec.target.model, monkeypatch)
    draft = spy_on(spec.draft.model, monkeypatch)
    record = measure_round(spec, points[0])  # b 3, k 3, sequences of 40 tokens
    assert isinstance(record, Record) and record.point == points[0]
    runs = grid.timing.cpu_warmup + grid.timing.cpu_repeats
    assert record.samples == grid.timing.cpu_repeats and record.p10 <= record.ms <= record.p90
    # each run: k one-token draft steps from the draft's c - 1 cached tokens (the first
    # feeds the one token it lacks), then the verify of k + 1 tokens at the target's c - 1
    assert draft == [((3, 1), None, False, [39 + i] * 3) for i in range(3)] * runs
    assert target == [((3, 4), [4, 4, 4], False, [39, 39, 39])] * runs
    assert len(spec.tracer.spans) == 0  # collected: a run's spans do not pile up
    for bench in (spec.target, spec.draft):
        assert all(bench.model.kv.length(s) == 0 for s in bench.slots)  # left empty
    target.clear()
    measure_round(spec, points[1])  # k = 1
    assert target == [((1, 2), [2], False, [7])] * runs
    # k = 0: a plain decode round of the target alone, its ids read by the host
    target.clear()
    draft.clear()
    record = measure_round(spec, Point("spec", "cpu", "round", 2, 1, 30))
    assert record.samples == grid.timing.cpu_repeats and draft == []
    assert target == [((2, 1), None, False, [29, 29])] * runs
    assert all(spec.target.model.kv.length(s) == 0 for s in spec.target.slots)


# -- the plan -----------------------------------------------------------------------------
def test_the_round_bench_builds_the_target_and_its_draft():
    grid, _ = load_grid("default")
    plan = make_plan(Request("qwen3-8b", grid, "default", "default", "cuda",
                             draft="qwen3-0.6b"))
    spec = next(b for b in plan.benches if b.name == "spec@gpu")
    assert (spec.model, spec.draft.model, spec.draft.name) == ("qwen3-8b", "qwen3-0.6b",
                                                               "draft@gpu")
    assert len(spec.points) == 30 and not spec.draft.points  # 6 batches x k 0, 1, 2, 4, 8
    est = plan.estimate
    from calibration.estimate import GPU, build_seconds

    target_alone = build_seconds(spec.shape, GPU, 2, None, graphs=0)  # weights, no graph
    assert est.builds["spec@gpu"] > target_alone  # the target, and the draft besides
    # more proposals and more sequences cost more
    assert (est.points["spec@gpu/round/b8/m9/c512"] > est.points["spec@gpu/round/b8/m2/c512"]
            > est.points["spec@gpu/round/b1/m2/c512"])
    assert plan.estimate.seconds < 8 * 60  # issue 23: the default grid under 8 minutes
    assert not [n for n in plan.notes if "round" in n]


@pytest.mark.parametrize("device, draft_device", [("cpu", None), ("cuda", "cpu")])
def test_rounds_without_a_gpu_draft_are_left_out_with_a_note(device, draft_device):
    grid, _ = load_grid("default")
    plan = make_plan(Request("qwen3-8b", grid, "default", "default", device,
                             draft="qwen3-0.6b", draft_device=draft_device))
    assert "spec@gpu" not in {b.name for b in plan.benches}
    assert any(n.startswith("round points are skipped") for n in plan.notes)
    alone = make_plan(Request("qwen3-8b", grid, "default", "default", device))
    assert not [n for n in alone.notes if "round" in n]  # no draft: no draft stage at all


# -- the profile's runtime ----------------------------------------------------------------
def options(graphs: bool) -> dict:
    gpu = {"backend": "cupy" if graphs else "torch", "graphs": graphs}
    return {"target@gpu": gpu, "draft@gpu": gpu, "draft@cpu": {"backend": "torch",
                                                               "graphs": False}}


def test_the_runtime_is_the_graphs_buckets_where_the_benches_run_graphs():
    from kestrel_rt.cuda.graphs import BUCKETS

    info = runtime_info({**FINGERPRINT, "options": options(True)})
    assert info.batch_buckets == list(BUCKETS) and BUCKETS[0] == 1 and BUCKETS[-1] == 64
    assert info.max_m == 16 and info.bucket(5, 17) == 5  # past max_m: eager, unpadded
    assert info.bucket(5, 3) == next(b for b in BUCKETS if b >= 5)
    from kestrel_rt.cuda.graphs import PREFILL_BUCKETS

    dense = runtime_info({**FINGERPRINT, "model": "qwen3-8b", "options": options(True)})
    assert dense.prefill_buckets == list(PREFILL_BUCKETS)
    moe = runtime_info({**FINGERPRINT, "model": "qwen3-30b-a3b", "options": options(True)})
    assert moe.prefill_buckets is None  # a MoE prefill runs eagerly
    # without graphs (graphs off, or no options recorded): no buckets, a forward per chunk
    for eager in (runtime_info({**FINGERPRINT, "options": options(False)}),
                  runtime_info(FINGERPRINT)):
        assert eager == RuntimeInfo(chunks="per_chunk") and eager.batch_buckets == []
        assert eager.prefill_buckets is None and eager.per_chunk and not eager.graphs


def test_parts_measured_apart_share_the_runtime_and_merge():
    point = Point("target", "gpu", "decode", 4, 1, 128)
    parts = [to_profile([Record(point, ms, 7, ms * 0.9, ms * 1.1)],
                        {**FINGERPRINT, "options": options(True)}) for ms in (4.0, 4.5)]
    merged = parts[0].merge(parts[1])
    assert merged.runtime == parts[0].runtime and merged.runtime.batch_buckets[-1] == 64
    assert len(merged.measurements) == 2
