"""Speculative rounds run ahead on the GPU (CupyBackend, CUDA graphs: a replay reuses its
graph's output buffer) give the same tokens, statistics and spans as round by round."""

from __future__ import annotations

from collections import Counter

import pytest

cupy = pytest.importorskip("cupy")

import gpu_models as gm

from kestrel_rt.spec import SpecConfig, speculative_generate
from kestrel_rt.trace import Tracer


@pytest.fixture(scope="module")
def pair():
    return gm.graphed(*gm.weights("wide")), gm.graphed(*gm.weights("wide", seed=1))


@pytest.mark.parametrize(("k", "alpha", "lengths", "max_new", "max_batch"), [
    (1, 0.8, [5], [60], None),
    (4, 0.8, [5, 12, 1, 7, 30], [40, 33, 21, 40, 9], 3),
    (2, 0.7, [2, 9, 5, 1], [30, 26, 28, 24], None),  # rows lag (n == k) beside rows that do not
    (8, 0.9, [3, 17], [50, 45], None),
])
def test_rounds_run_ahead_as_round_by_round_on_the_gpu(pair, k, alpha, lengths, max_new,
                                                       max_batch):
    target, draft = pair
    prompts = gm.prompts(target.shape.vocab_size, lengths)
    config = SpecConfig(k=k, acceptance={"alpha": alpha}, seed=3)
    runs = []
    for run_ahead in (True, False):
        tracer = Tracer(target.device)
        got = speculative_generate(target, draft, prompts, max_new, config, tracer=tracer,
                                   run_ahead=run_ahead, max_batch=max_batch)
        spans = Counter((s.kind, s.worker, tuple(s.requests), s.tokens, s.context, s.proposed,
                         tuple(s.accepted or ())) for s in tracer.collect())
        runs.append((got, spans))
    (on, spans_on), (off, spans_off) = runs
    assert on.token_ids == off.token_ids
    assert [len(t) for t in on.token_ids] == max_new
    assert on.stats == off.stats and on.decode_steps == off.decode_steps
    assert spans_on == spans_off
    assert on.rounds_ahead > 0 and off.rounds_ahead == 0
    assert target.replays > 0 and draft.replays > 0
