"""The prefill graphs a warm-up captures (kestrel_rt/cuda/graph_shapes.py prefill_warm_shapes):
exactly the (bucket, keys) shapes GraphModel._shape gives the chunks a run can send it, found
here by trying every chunk length at every start; and which runs can send a chunk that starts
mid-sequence (kestrel_rt/serve/forward.py chunk_limits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kestrel_rt.cuda.graph_shapes import (
    MAX_M,
    PREFILL_BUCKETS,
    PREFILL_MIN_KEYS,
    prefill_keys,
    prefill_warm_shapes,
)
from kestrel_rt.cuda.graphs import GraphModel
from kestrel_rt.serve.forward import WARM_PREFILL_LIMIT, chunk_limits
from kestrel_rt.serve.settings import ServeSettings


def shape_model(buckets, max_len: int, min_keys: int) -> SimpleNamespace:
    """What GraphModel._shape reads of a model, every shape graph-safe."""
    return SimpleNamespace(backend=SimpleNamespace(graph_safe=lambda rows, m: True),
                           scratch_slot=0, kv=SimpleNamespace(max_len=max_len), max_m=MAX_M,
                           prefill_buckets=tuple(buckets), prefill_min_keys=min_keys)


def replayed(buckets, max_len: int, longest_chunk: int, starts, min_keys: int) -> set:
    """(bucket, keys) of every prefill graph GraphModel._shape picks for a chunk of
    max_m + 1 .. longest_chunk tokens at one of `starts` (eager chunks: none); the lengths
    tried are the least and the most of each bucket's (and max_m + 1, longest_chunk)."""
    model = shape_model(buckets, max_len, min_keys)
    edges = {MAX_M + 1, longest_chunk} | {b + d for b in buckets for d in (0, 1)}
    out = set()
    for start in starts:
        for n in sorted(e for e in edges if MAX_M < e <= min(longest_chunk, max_len - start)):
            shape = GraphModel._shape(model, 1, n, True, [start])
            if shape is not None:
                out.add((shape[1], shape[2]))
    return out


LIGHT_LOAD_MAX_LEN = 5215  # light-load-mixed-lengths: prompts to 4097, outputs to 512, k = 4


def test_light_load_covers_chunks_at_2048_and_4096():
    shapes = prefill_warm_shapes(PREFILL_BUCKETS, LIGHT_LOAD_MAX_LEN, 2048, True)
    # the continuation chunk measured at 110 ms on the H200 (111 tokens at context 2048)
    assert (128, prefill_keys(2048, 128, LIGHT_LOAD_MAX_LEN)) in shapes
    assert prefill_keys(2048, 128, LIGHT_LOAD_MAX_LEN) == 4096
    for start in (0, 2048, 4096):
        for n in (100, 1000, 2048):
            bucket = next(b for b in PREFILL_BUCKETS if b >= n)
            if start + bucket <= LIGHT_LOAD_MAX_LEN:
                assert (bucket, prefill_keys(start, bucket, LIGHT_LOAD_MAX_LEN)) in shapes
    # 12 buckets up to 2048, each at keys 2048, 4096 and the whole cache
    assert len(shapes) == 36
    assert {keys for _, keys in shapes} == {2048, 4096, LIGHT_LOAD_MAX_LEN}
    # without mid-sequence starts: each bucket at its own level only, as before
    assert prefill_warm_shapes(PREFILL_BUCKETS, LIGHT_LOAD_MAX_LEN, 2048, False) == [
        (b, 2048) for b in PREFILL_BUCKETS if b <= 2048]


@pytest.mark.parametrize("max_len, longest_chunk, min_keys", [
    (5215, 2048, PREFILL_MIN_KEYS),  # light-load-mixed-lengths
    (700, 256, 64),
    (1024, 300, 64),  # a power-of-two cache
    (900, 900, 128),  # chunks as long as the cache
    (100, 64, 2048),  # a cache shorter than the least keys
])
@pytest.mark.parametrize("mid", [True, False])
def test_the_shapes_are_exactly_what_chunks_replay(max_len, longest_chunk, min_keys, mid):
    buckets = tuple(b for b in PREFILL_BUCKETS if b <= 1024) if max_len < 5000 else PREFILL_BUCKETS
    shapes = prefill_warm_shapes(buckets, max_len, longest_chunk, mid, min_keys)
    starts = range(max_len) if mid else [0]
    assert set(shapes) == replayed(buckets, max_len, longest_chunk, starts, min_keys)
    assert len(shapes) == len(set(shapes))
    assert shapes == sorted(shapes, key=lambda s: (s[1], s[0]))
    for bucket, keys in shapes:  # the start warm_up captures each at reaches its keys
        start = keys - bucket
        assert start >= 0 and start + bucket <= max_len
        assert prefill_keys(start, bucket, max_len, min_keys) == keys


def test_the_longest_cache_stays_under_the_warm_up_bound():
    # qwen3's whole context in 8192-token chunks: 16 buckets, up to 6 keys levels each
    shapes = prefill_warm_shapes(PREFILL_BUCKETS, 40960, 8192, True)
    assert len(shapes) == 90 <= WARM_PREFILL_LIMIT
    assert {keys for _, keys in shapes} == {2048, 4096, 8192, 16384, 32768, 40960}


def settings(**changes) -> ServeSettings:
    base = {"mode": "colocated", "max_batch": 64, "max_tokens": 8192, "chunk": 2048,
            "mixed": True, "preempt": True, "decode_order": "fifo", "kv_capacity": 417050,
            "k": 4}
    return ServeSettings(**{**base, **changes})


def test_light_load_starts_chunks_mid_prompt():
    # light-load-mixed-lengths on the H200: prompts up to 4097 tokens, requests up to 4154
    assert chunk_limits(settings(), 4097, 4154) == (2048, True)


def test_short_prompts_in_a_roomy_budget_start_at_zero_only():
    s = settings(max_batch=4, max_tokens=8192, chunk=2048)
    assert chunk_limits(s, 1500, 2000) == (1500, False)
    # the budget can cut a chunk: 4 prompts of 2100 tokens do not fit 8192 tokens
    assert chunk_limits(s, 2100, 2200) == (2048, True)
    assert chunk_limits(settings(max_batch=8, chunk=2048), 1500, 2000)[1]  # 8 x 1500 > 8192


def test_a_preemption_recomputes_prompt_and_output():
    # the KV budget cannot hold max_batch requests: a preempted one is prefilled again, its
    # generated tokens too, from its first token
    tight = settings(max_batch=4, kv_capacity=4000)
    assert chunk_limits(tight, 1000, 1500) == (1500, False)
    assert chunk_limits(tight, 1000, 2100) == (2048, True)
    # under `wait` nothing is preempted: the prompt is the longest prefill
    assert chunk_limits(settings(max_batch=4, kv_capacity=4000, preempt=False), 1000,
                        2100) == (1000, False)


def test_past_the_bound_the_longest_contexts_are_left_out(monkeypatch):
    from kestrel_rt.serve import forward

    model = shape_model(PREFILL_BUCKETS, LIGHT_LOAD_MAX_LEN, PREFILL_MIN_KEYS)
    steps, left_out = forward.chunk_steps(model, 2048, True)
    assert left_out == 0 and len(steps) == MAX_M + 36  # each small length, each prefill shape
    monkeypatch.setattr(forward, "WARM_PREFILL_LIMIT", 30)
    steps, left_out = forward.chunk_steps(model, 2048, True)
    prefill = [(m, m + start) for _, m, _, start in steps if m > MAX_M]  # (bucket, keys)
    assert left_out == 6 and len(prefill) == 30
    assert {keys for _, keys in prefill} == {2048, 4096, LIGHT_LOAD_MAX_LEN}
    assert sum(keys == LIGHT_LOAD_MAX_LEN for _, keys in prefill) == 6  # the 6 smallest buckets
