"""Speculative rounds run ahead (kestrel_rt/spec/ahead.py) give round()'s tokens, statistics
and spans, token for token; they run where they may, and nowhere else."""

from __future__ import annotations

from functools import cache

import pytest
import spec_models as sm
from hypothesis import given, settings
from hypothesis import strategies as st

import kestrel_rt.spec.ahead as ahead_module
from kestrel_rt.spec import SpecConfig, speculative_generate
from kestrel_rt.trace import Tracer


@cache
def pair(kind: str):
    """(target, draft) of the "untied" tiny model, reused (each run allocates its caches)."""
    shape, hf = sm.weights()
    return sm.model(shape, hf), sm.draft(kind, shape, hf)


def both(kind: str, prompts, max_new, config: SpecConfig, **options):
    """The run with run_ahead on and off: (result, spans without their times) for each."""
    target, draft = pair(kind)
    runs = []
    for run_ahead in (True, False):
        tracer = Tracer()
        got = speculative_generate(target, draft, prompts, max_new, config, tracer=tracer,
                                   run_ahead=run_ahead, **options)
        spans = [(s.kind, s.worker, s.requests, s.tokens, s.context, s.proposed, s.accepted)
                 for s in tracer.collect()]
        runs.append((got, spans))
    return runs


def assert_same(on, off) -> None:
    (a, spans_a), (b, spans_b) = on, off
    assert a.token_ids == b.token_ids
    assert a.stats == b.stats
    assert a.decode_steps == b.decode_steps
    assert spans_a == spans_b
    assert b.rounds_ahead == 0


acceptances = st.one_of(
    st.builds(lambda a: {"alpha": a}, st.floats(0.0, 1.0)),
    st.builds(lambda r: {"per_position": r}, st.lists(st.floats(0.0, 1.0), min_size=8,
                                                      max_size=8)))


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 8),
    acceptance=acceptances,
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    news=st.data(),
    max_batch=st.one_of(st.none(), st.integers(1, 3)),
    seed=st.integers(0, 50),
)
def test_rounds_run_ahead_as_round_runs_them(k, acceptance, lengths, news, max_batch, seed):
    """Controlled, greedy, fused: the same tokens, statistics and spans (kinds, workers,
    requests, tokens, context, proposed, accepted) with and without running ahead, over
    batches whose rows start and finish at different rounds."""
    prompts = sm.prompts(96, lengths, seed)
    max_new = news.draw(st.lists(st.integers(0, 24), min_size=len(prompts),
                                 max_size=len(prompts)))
    config = SpecConfig(k=k, acceptance=acceptance, seed=seed)
    on, off = both("other", prompts, max_new, config, max_batch=max_batch)
    assert_same(on, off)
    got = on[0]
    assert [len(t) for t in got.token_ids] == max_new  # no eos: every row runs to its limit
    # a round not run ahead starts a stretch, which ends only with a round that leaves some
    # row done, or is a round before which a prompt waits for a free slot (it joins after)
    joiners = 0 if max_batch is None else len(prompts)
    assert got.decode_steps - got.rounds_ahead <= sum(n >= 2 for n in max_new) + joiners


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("acceptance", [{"alpha": 0.8}, {"alpha": 1.0},
                                        {"per_position": [0.9, 0.5, 0.3, 0.8, 0.1, 1, 1, 0]}])
def test_one_request_runs_every_round_but_its_first_ahead(k, acceptance):
    """Batch 1: one stretch, its row done only after the last round."""
    prompts = sm.prompts(96, [6])
    on, off = both("noisy0.1", prompts, 40, SpecConfig(k=k, acceptance=acceptance, seed=4))
    assert_same(on, off)
    got = on[0]
    assert got.decode_steps > 1
    assert got.rounds_ahead == got.decode_steps - 1


def test_rows_that_lag_and_rows_that_do_not_share_a_round():
    """Alpha 0.7, k = 2, a batch of 4: rounds where some rows accepted all k (the draft's
    next first step feeds [d_k, g_n]) and others not ([g_n], padded)."""
    prompts = sm.prompts(96, [2, 9, 5, 1])
    config = SpecConfig(k=2, acceptance={"alpha": 0.7}, seed=9)
    on, off = both("other", prompts, [30, 26, 28, 24], config)
    assert_same(on, off)
    first_steps = [s for s in on[1] if s[0] == "draft"][::2]  # k = 2 steps a round
    assert any(len(s[2]) == 4 and 4 < s[3] < 8 for s in first_steps)  # 1 or 2 tokens a row
    assert on[0].rounds_ahead > 0


def test_a_prompt_waiting_for_a_free_slot_joins_after_the_round():
    """Prompt 0 is done at its prefill: its slot is free for prompt 2 during the next round,
    which therefore does not run ahead (prompt 2 joins after it, as round by round)."""
    prompts = sm.prompts(96, [6, 3, 10, 2], seed=26)
    config = SpecConfig(k=4, acceptance={"alpha": 0.5}, seed=26)
    on, off = both("noisy0.1", prompts, [1, 9, 20, 17], config, max_batch=2)
    assert_same(on, off)
    assert 0 < on[0].rounds_ahead < on[0].decode_steps - 1


@pytest.mark.parametrize(("kind", "options", "run"), [
    ("noisy0.1", {"k": 3, "acceptance": {"alpha": 0.8}, "correction": "separate", "seed": 2},
     {}),
    ("noisy0.1", {"k": 3}, {}),  # organic: greedy acceptance judged on the device
    ("noisy0.1", {"k": 3, "correction": "separate"}, {}),
    ("noisy0.1", {"k": 3, "temperature": 0.8, "seed": 1}, {}),  # sampled
    ("noisy0.1", {"k": 3, "temperature": 0.8, "seed": 1, "acceptance": {"alpha": 0.8}}, {}),
    ("other", {"k": 3, "acceptance": {"alpha": 0.8}, "seed": 1}, {"eos_token_id": [5, 7]}),
])
def test_other_rounds_are_round_as_before(kind, options, run):
    """Separate correction, organic acceptance, sampling or end-of-sequence tokens: every
    round is SpecDecoder.round (none ahead), with the same results either way."""
    prompts = sm.prompts(96, [3, 8, 1])
    on, off = both(kind, prompts, [20, 14, 25], SpecConfig(**options), **run)
    assert_same(on, off)
    assert on[0].rounds_ahead == 0 and on[0].decode_steps > 3


def test_a_round_that_accepts_other_than_drawn_is_an_error(monkeypatch):
    """The n read back is checked against the n drawn: a wrong device copy is caught."""
    real = ahead_module.to_device

    def corrupt(values, device):  # the draws of a round launched ahead: each n + 1, wrapped
        if values and isinstance(values[0], int):
            values = [(n + 1) % 4 for n in values]
        return real(values, device)

    monkeypatch.setattr(ahead_module, "to_device", corrupt)
    target, draft = pair("other")
    with pytest.raises(RuntimeError, match="drawn"):
        speculative_generate(target, draft, sm.prompts(96, [4]), 30,
                             SpecConfig(k=3, acceptance={"alpha": 0.8}, seed=0))
