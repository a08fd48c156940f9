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
        # two disaggregated workers' steps at once (overlap, on the pair of instances)
        assert {p.stage for p in points} == {"decode", "verify", "correction", "prefill",
                                             "mixed", "draft", "kv_transfer", "overlap"}
        assert {p.bench for p in points} == {"target@gpu", "draft@gpu", "draft@cpu",
                                             "pair@gpu"}
        assert "overlap" not in {p.stage for p in expand(grid, "cpu", ("cpu",))}


def test_points_are_grouped_by_bench_and_have_stable_ids():
    grid, _ = load_grid("tiny")
    points = expand(grid, "gpu", ("gpu", "cpu"))
    benches = [p.bench for p in points]
    # each model instance's points are contiguous: target, draft on the GPU, on the CPU,
    # then the pair of target instances (overlap)
    order = ["target@gpu", "draft@gpu", "draft@cpu", "pair@gpu"]
    assert benches == sorted(benches, key=order.index)
    ids = {p.id for p in points}
    assert "target@gpu/verify/b2/m4/c32" in ids  # k = 3 -> M = 4
    assert "target@gpu/mixed/b2/m3/c16/chunk8@16" in ids
    assert "target@gpu/correction/b2/m1/c32/after-k3" in ids
    assert "draft@cpu/draft/b4/m1/c64" in ids
    assert "draft@gpu/kv_transfer/n128" in ids
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
