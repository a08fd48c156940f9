"""Greedy speculative decoding equals plain greedy decoding token for token; KV lengths, the
round's stages in the trace, and the two models' separate weights."""

from __future__ import annotations

import itertools
from functools import cache

import pytest
import spec_models as sm
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_rt.engine import generate
from kestrel_rt.spec import SpecConfig, SpecDecoder, speculative_generate
from kestrel_rt.trace import Tracer
from kestrel_sim.errors import KestrelError


@cache
def pair(kind: str):
    """(target, draft) of the "untied" tiny model; models are reused across examples (each
    generate call allocates fresh caches)."""
    shape, hf = sm.weights()
    return sm.model(shape, hf), sm.draft(kind, shape, hf)


@cache
def plain(prompts: tuple[tuple[int, ...], ...], new: int, eos: int | None) -> list[list[int]]:
    target, _ = pair("same")
    return generate(target, [list(p) for p in prompts], new, eos_token_id=eos).token_ids


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 8),
    correction=st.sampled_from(["fused", "separate"]),
    kind=st.sampled_from(sm.DRAFTS),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    news=st.data(),
    max_batch=st.one_of(st.none(), st.integers(1, 3)),
    eos=st.one_of(st.none(), st.integers(0, 95)),
    seed=st.integers(0, 50),
)
def test_greedy_speculative_equals_plain_greedy(k, correction, kind, lengths, news, max_batch,
                                                eos, seed):
    target, draft = pair(kind)
    prompts = sm.prompts(target.shape.vocab_size, lengths, seed)
    max_new = news.draw(st.lists(st.integers(0, 24), min_size=len(prompts),
                                 max_size=len(prompts)))
    ref = plain(tuple(map(tuple, prompts)), max(max_new), eos)
    got = speculative_generate(target, draft, prompts, max_new,
                               SpecConfig(k=k, correction=correction), eos_token_id=eos,
                               max_batch=max_batch)
    assert got.token_ids == [r[:n] for r, n in zip(ref, max_new)]
    assert got.stats.accepted_tokens <= got.stats.draft_tokens


@pytest.mark.parametrize("correction", ["fused", "separate"])
def test_context_limits_speculative_as_plain(correction):
    """A short context: sequences stop at prompt + generated = max_position_embeddings."""
    shape, hf = sm.weights()
    shape = shape.model_copy(update={"max_position_embeddings": 24})
    target, draft = sm.model(shape, hf), sm.model(shape, sm.noisy(hf, 0.03))
    prompts = sm.prompts(shape.vocab_size, [20, 11, 3])
    ref = generate(target, prompts, 40).token_ids
    got = speculative_generate(target, draft, prompts, 40, SpecConfig(k=6, correction=correction))
    assert got.token_ids == ref
    assert [len(p) + len(t) for p, t in zip(prompts, got.token_ids)] == [24, 24, 24]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_a_draft_equal_to_the_target_accepts_everything(k):
    target, draft = pair("same")
    prompts = sm.prompts(target.shape.vocab_size, [4, 9])
    got = speculative_generate(target, draft, prompts, 30, SpecConfig(k=k))
    s = got.stats
    assert s.accepted_tokens == s.draft_tokens > 0
    assert s.acceptance_rate == 100.0
    assert s.per_position_rates() == [1.0] * k
    # 29 tokens after the prefill's first, k + 1 per round
    assert got.decode_steps == -(-29 // (k + 1))


@pytest.mark.parametrize("correction", ["fused", "separate"])
@pytest.mark.parametrize("kind", ["same", "noisy0.1"])
def test_kv_lengths_follow_the_emitted_tokens(correction, kind):
    """After every round: the target holds all tokens but the last; the draft the same, or
    one fewer after a round that accepted all k proposals."""
    shape, hf = sm.weights()
    target, draft = sm.model(shape, hf), sm.draft(kind, shape, hf)
    k = 3
    dec = SpecDecoder(target, draft, SpecConfig(k=k, correction=correction))
    dec.allocate_kv(3, 64)
    prompts = sm.prompts(shape.vocab_size, [5, 1, 8])
    seqs = [dec.add(i, p, 40) for i, p in enumerate(prompts)]
    dec.prefill(seqs)
    for s in seqs:
        assert target.kv.length(s.target_slot) == draft.kv.length(s.draft_slot) == len(s.tokens) - 1
    lags = 0
    for _ in range(8):
        before = [len(s.tokens) for s in seqs]
        emitted = dec.round(seqs)
        for s, n0, new in zip(seqs, before, emitted):
            assert len(s.tokens) == n0 + len(new)
            assert target.kv.length(s.target_slot) == len(s.tokens) - 1
            lag = len(new) == k + 1  # all k proposals accepted
            lags += lag
            assert draft.kv.length(s.draft_slot) == len(s.tokens) - 1 - lag
    assert lags > 0


def test_each_stage_is_a_span():
    target, draft = pair("noisy0.1")
    tracer = Tracer()
    k = 2
    dec = SpecDecoder(target, draft, SpecConfig(k=k, correction="separate"), tracer)
    dec.allocate_kv(2, 64)
    seqs = [dec.add(i, p, 30) for i, p in enumerate(sm.prompts(96, [3, 6]))]
    dec.prefill(seqs)
    emitted = dec.round(seqs)
    spans = tracer.collect()
    kinds = [(s.kind, s.worker) for s in spans]
    assert kinds == [("prefill", "cpu/target"), ("prefill", "cpu/draft")] + \
        [("draft", "cpu/draft")] * k + [("verify", "cpu/target"), ("correction", "cpu/target")]
    verify = spans[2 + k]
    assert verify.proposed == k and verify.requests == [0, 1]
    assert verify.accepted == [len(e) - 1 for e in emitted]
    assert verify.tokens == 2 * (k + 1)
    assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(spans))


def test_the_draft_never_shares_weights_with_its_target():
    shape, hf = sm.weights()
    target, draft = sm.model(shape, hf), sm.model(shape, hf)  # same values, own copies

    def storages(m):
        return {t.untyped_storage().data_ptr() for t in m.backend._weights.values()}

    assert storages(target).isdisjoint(storages(draft))
    with pytest.raises(KestrelError, match="own backend"):
        SpecDecoder(target, target)
    # the draft's forwards leave the target's results as they were
    prompts = sm.prompts(shape.vocab_size, [4])
    before = generate(target, prompts, 10).token_ids
    speculative_generate(target, sm.draft("other", shape, hf), prompts, 10, SpecConfig(k=3))
    assert generate(target, prompts, 10).token_ids == before


def test_draft_with_another_vocabulary_is_refused():
    shape, hf = sm.weights()
    other = shape.model_copy(update={"vocab_size": 64})
    small = {k: (v[:64] if v.shape[0] == 96 else v) for k, v in hf.items()}
    with pytest.raises(KestrelError, match="vocab"):
        SpecDecoder(sm.model(shape, hf), sm.model(other, small))


def test_bad_settings_are_refused_with_the_key():
    from kestrel_sim.errors import ConfigError

    with pytest.raises(ConfigError, match="k"):
        SpecConfig.parse(k=17)
    with pytest.raises(ConfigError, match="per_position"):
        SpecConfig.parse(k=4, acceptance={"per_position": [0.5, 0.5]})
    with pytest.raises(ConfigError, match="bogus"):
        SpecConfig.parse(bogus=1)
    target, draft = pair("same")
    with pytest.raises(KestrelError, match="prompt 1 is empty"):
        speculative_generate(target, draft, [[1], []], 4)
    with pytest.raises(KestrelError, match="one per prompt"):
        speculative_generate(target, draft, [[1], [2]], [4])
