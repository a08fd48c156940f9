"""Greedy speculative decoding on the GPU (CupyBackend, CUDA graphs) equals plain greedy
decoding token for token, with the draft on the GPU or on the CPU; sampled and controlled
rounds run there too."""

from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy")

import gpu_models as gm
import spec_models as sm

from kestrel_rt.engine import generate
from kestrel_rt.spec import SpecConfig, speculative_generate


@pytest.fixture(scope="module")
def target_and_drafts():
    shape, hf = gm.weights("wide")
    noisy = sm.noisy(hf, 0.03)
    return gm.graphed(shape, hf), {
        "same": gm.graphed(shape, hf),
        "noisy": gm.graphed(shape, noisy),
        "other": gm.graphed(*gm.weights("wide", seed=1)),
        "cpu-noisy": sm.model(shape, noisy),  # the draft on the CPU torch backend
    }


@pytest.mark.parametrize("draft", ["same", "noisy", "other", "cpu-noisy"])
@pytest.mark.parametrize("correction", ["fused", "separate"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_speculative_equals_plain_greedy_on_the_gpu(target_and_drafts, draft,
                                                           correction, k):
    target, drafts = target_and_drafts
    prompts = gm.prompts(target.shape.vocab_size, [5, 12, 1, 7, 30])
    ref = generate(target, prompts, 40).token_ids
    got = speculative_generate(target, drafts[draft], prompts, 40,
                               SpecConfig(k=k, correction=correction), max_batch=3)
    assert got.token_ids == ref
    assert target.replays > 0


@pytest.mark.parametrize("acceptance", [None, {"alpha": 0.7}])
def test_sampled_and_controlled_rounds_run_on_the_gpu(target_and_drafts, acceptance):
    target, drafts = target_and_drafts
    prompts = gm.prompts(target.shape.vocab_size, [5, 12, 1])
    cfg = SpecConfig(k=4, temperature=0.8, top_p=0.9, seed=1, acceptance=acceptance)
    a = speculative_generate(target, drafts["noisy"], prompts, 40, cfg)
    b = speculative_generate(target, drafts["noisy"], prompts, 40, cfg)
    assert a.token_ids == b.token_ids  # seeded
    assert [len(t) for t in a.token_ids] == [40, 40, 40]
    assert a.stats.num_drafts > 0
