"""Calibration grids: YAML in, independent points out; errors name file, line and key; the
default grid's time estimate fits the 8-minute budget on an H200."""

from __future__ import annotations

import pytest

from calibration.grid import Grid, Point, bundled_grids, chunk_steps, expand, load_grid
from kestrel_sim.errors import ConfigError


def write(tmp_path, text: str):
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


def test_bundled_grids_load_and_expand_without_repeats():
    assert {"default", "quick", "tiny"} <= set(bundled_grids())
    for name in bundled_grids():
        grid, got = load_grid(name)
        assert got == name
        points = expand(grid, "gpu", ("gpu", "cpu"))
        ids = [p.id for p in points]
        assert len(ids) == len(set(ids))
        # every stage of the issue is measured by every bundled grid, and on a GPU the
        # two disaggregated workers' steps at once (overlap, on the pair of instances) and
        # whole speculative rounds (on the target with its draft); the MoE grid leaves out
        # overlap (its bundled scenario runs colocated)
        pair = set() if name == "moe" else {"overlap"}
        assert {p.stage for p in points} == {"decode", "verify", "correction", "prefill",
                                             "mixed", "draft", "draft_prefill", "kv_transfer",
                                             "round"} | pair
        # the default grid times the CPU draft's steps inside rounds (spec@cpu)
        in_rounds = {"spec@cpu"} if name == "default" else set()
        assert {p.bench for p in points} == {"target@gpu", "draft@gpu", "draft@cpu",
                                             "spec@gpu"} | ({"pair@gpu"} if pair else
                                                            set()) | in_rounds
        assert {(p.m, p.catch_up) for p in points if p.bench == "draft@gpu"
                and p.stage == "draft"} == {(1, False), (2, True)}
        on_cpu = {p.stage for p in expand(grid, "cpu", ("cpu",))}
        assert not on_cpu & {"overlap", "round"}


def test_points_are_grouped_by_bench_and_have_stable_ids():
    grid, _ = load_grid("tiny")
    points = expand(grid, "gpu", ("gpu", "cpu"))
    benches = [p.bench for p in points]
    # each model instance's points are contiguous: target, draft on the GPU, on the CPU,
    # then the pair of target instances (overlap), then the target with its draft (round)
    order = ["target@gpu", "draft@gpu", "draft@cpu", "pair@gpu", "spec@gpu"]
    assert benches == sorted(benches, key=order.index)
    ids = {p.id for p in points}
    assert "target@gpu/verify/b2/m4/c32" in ids  # k = 3 -> M = 4
    assert "target@gpu/mixed/b2/m3/c16/chunk8@16" in ids
    assert "target@gpu/correction/b2/m1/c32/after-k3" in ids
    assert "draft@cpu/draft/b4/m1/c64" in ids
    assert "draft@gpu/kv_transfer/n128" in ids
    assert "draft@gpu/draft/b4/m2/c64" in ids  # a round's first draft step (catch-up)
    assert "draft@cpu/draft_prefill/b1/m16/c32" in ids  # the third chunk of 48 tokens
    assert "spec@gpu/round/b4/m4/c32" in ids  # k = 3 -> M = 4
    # the same grid expands to the same ids
    assert [p.id for p in expand(grid, "gpu", ("gpu", "cpu"))] == [p.id for p in points]


def test_chunked_prompts_measure_each_chunk_at_its_context_once():
    assert chunk_steps(48, 16) == [(16, 0), (16, 16), (16, 32)]
    assert chunk_steps(40, 16) == [(16, 0), (16, 16), (8, 32)]  # a short last chunk
    assert chunk_steps(16, 64) == [(16, 0)]  # a chunk >= the prompt: the whole prompt
    grid = Grid.model_validate({"prefill": {"batches": [1, 4], "prompts": [32, 64],
                                            "chunks": [16, 64], "max_step_tokens": 128}})
    pre = [(p.batch, p.m, p.context) for p in expand(grid, "gpu")]
    # prompt 32 in chunks of 16 shares its steps with prompt 64's first two
    assert sorted(pre) == sorted([(1, 16, 0), (1, 16, 16), (1, 16, 32), (1, 16, 48),
                                  (1, 32, 0), (1, 64, 0),
                                  (4, 16, 0), (4, 16, 16), (4, 16, 32), (4, 16, 48),
                                  (4, 32, 0)])  # 4 x 64 tokens > max_step_tokens: left out


def test_point_reach_and_slots():
    mixed = Point("target", "gpu", "mixed", batch=8, m=5, context=100, chunk_tokens=64,
                  chunk_context=512)
    assert (mixed.reach, mixed.slots) == (576, 9)
    corr = Point("target", "gpu", "correction", batch=4, m=1, context=100, after_k=4)
    assert corr.reach == 105  # the verify before it writes k + 1 tokens


def test_unknown_key_is_named_with_file_and_line(tmp_path):
    path = write(tmp_path, "decode:\n  batches: [1]\n  contexts: [8]\n  context: [9]\n")
    with pytest.raises(ConfigError) as err:
        load_grid(path)
    msg = str(err.value)
    assert f"{path}:4: decode.context: unknown key 'context'" in msg
    assert "contexts" in msg  # the allowed keys


@pytest.mark.parametrize("text, key, what", [
    ("decode: {batches: [0], contexts: [8]}\n", "decode.batches", "batch must be >= 1"),
    ("verify: {batches: [1], k: [16], contexts: [8]}\n", "verify.k", "at most 15"),
    ("prefill: {batches: [1], prompts: [], chunks: [8]}\n", "prefill.prompts",
     "at least one"),
    ("timing: {repeats: 0}\n", "timing.repeats", ">= 1"),
    ("mixed: {batches: [2], k: [0], contexts: [8], chunks: [8]}\n", "mixed.chunk_contexts",
     "missing"),
    ("round: {batches: [1], k: [16], contexts: [8]}\n", "round.k", "at most 15"),
    ("round: {batches: [1], k: [2], contexts: [0]}\n", "round.contexts",
     "every context must be >= 1"),
    ("round: {batches: [1], k: [2], context: [8]}\n", "round.context", "unknown key"),
    ("draft: {gpu: {batches: [1], contexts: [8], new_tokens: [0]}}\n",
     "draft.gpu.new_tokens", "must be >= 1"),
])
def test_bad_values_are_named(tmp_path, text, key, what):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_grid(path)
    msg = str(err.value)
    assert f"{path}:1: {key}" in msg
    assert what in msg


def test_missing_grid_file_and_unknown_bundled_name():
    with pytest.raises(ConfigError, match="neither a file nor a bundled grid: expected one of"):
        load_grid("nosuchgrid")
    with pytest.raises(ConfigError, match="grid file nosuch/grid.yaml not found"):
        load_grid("nosuch/grid.yaml")


def test_a_draft_prefill_is_named_where_it_is_wrong(tmp_path):
    path = write(tmp_path, "draft:\n  cpu:\n    batches: [1]\n    contexts: [8]\n"
                 "    prefill:\n      batches: [1]\n      prompts: [0]\n      chunks: [8]\n")
    with pytest.raises(ConfigError) as err:
        load_grid(path)
    assert f"{path}:7: draft.cpu.prefill.prompts: every length must be >= 1" in str(err.value)


def test_draft_prefill_and_round_points():
    grid = Grid.model_validate({
        "draft": {"gpu": {"batches": [4], "contexts": [64], "new_tokens": [2, 1],
                          "prefill": {"batches": [1], "prompts": [32, 64], "chunks": [32]}}},
        "round": {"batches": [8, 1], "k": [4, 1], "contexts": [512]}})
    points = expand(grid, "gpu", ("gpu", "cpu"))
    ids = [p.id for p in points]
    assert len(ids) == len(set(ids))
    # the draft's prompt chunks as the target's: each chunk step once (32 shares 64's first)
    assert [(p.m, p.context) for p in points if p.stage == "draft_prefill"] == [(32, 0),
                                                                               (32, 32)]
    assert {p.bench for p in points if p.stage == "draft_prefill"} == {"draft@gpu"}
    assert [p.id for p in points if p.stage == "draft"] == ["draft@gpu/draft/b4/m1/c64",
                                                            "draft@gpu/draft/b4/m2/c64"]
    rounds = [p for p in points if p.stage == "round"]
    assert [(p.batch, p.m, p.context) for p in rounds] == [(1, 2, 512), (1, 5, 512),
                                                           (8, 2, 512), (8, 5, 512)]
    assert rounds[-1].id == "spec@gpu/round/b8/m5/c512" and rounds[-1].bench == "spec@gpu"
    assert rounds[-1].reach == 512 + 5  # the sequence's context, its k proposals and one
    # a round needs the target and the draft on a GPU
    assert not [p for p in expand(grid, "gpu", ("cpu",)) if p.stage == "round"]
    assert not [p for p in expand(grid, "gpu") if p.stage == "round"]
    assert not [p for p in expand(grid, "cpu", ("cpu",)) if p.stage == "round"]

