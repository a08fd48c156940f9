"""Controlled acceptance follows the simulator's acceptance models; statistics are counted
right (vLLM's names)."""

from __future__ import annotations

import pytest
import spec_models as sm

from kestrel_rt.engine import generate
from kestrel_rt.spec import SpecConfig, SpecDecoder, SpecStats, speculative_generate
from kestrel_rt.trace import Tracer


@pytest.mark.parametrize(("acceptance", "rates"), [
    ({"alpha": 0.6}, [0.6] * 4),
    ({"per_position": [0.9, 0.5, 0.3, 0.8, 0.1]}, [0.9, 0.5, 0.3, 0.8]),
])
@pytest.mark.parametrize(("temperature", "correction"), [(0.0, "fused"), (0.8, "separate")])
def test_controlled_acceptance_matches_the_given_rates(acceptance, rates, temperature,
                                                       correction):
    """P(position i accepted | 0..i-1 accepted) as given, over thousands of drafts of 200 sequences;
    a random draft (which would accept nothing) does all the work."""
    shape, hf = sm.weights()
    target, draft = sm.model(shape, hf), sm.draft("other", shape, hf)
    prompts = sm.prompts(shape.vocab_size, [1 + i % 7 for i in range(200)])
    cfg = SpecConfig(k=4, acceptance=acceptance, seed=3, temperature=temperature,
                     correction=correction)
    got = speculative_generate(target, draft, prompts, 40, cfg)
    s = got.stats
    assert s.controlled and s.as_dict()["spec_decode_controlled"] is True
    assert s.num_drafts > 2000 and min(s.reached_at) > 300
    for i, (measured, given) in enumerate(zip(s.conditional_rates(), rates)):
        assert measured == pytest.approx(given, abs=0.05), f"position {i}"
    assert all(len(t) == 40 for t in got.token_ids)


def test_controlled_rounds_emit_the_drafts_and_the_targets_next_token():
    """Greedy, controlled: a round emits the first n proposals (the draft's own greedy
    continuation) then the target's argmax after them; the verify span carries the drawn
    accepted lengths."""
    shape, hf = sm.weights()
    dshape, dhf = sm.weights(seed=1)
    target, draft = sm.model(shape, hf), sm.model(dshape, dhf)
    ref_target, ref_draft = sm.model(shape, hf), sm.model(dshape, dhf)  # own caches
    tracer = Tracer()
    dec = SpecDecoder(target, draft, SpecConfig(k=3, acceptance={"alpha": 0.7}, seed=1), tracer)
    dec.allocate_kv(2, 64)
    seqs = [dec.add(i, p, 30) for i, p in enumerate(sm.prompts(96, [4, 6]))]
    dec.prefill(seqs)
    accepted = []
    for _ in range(5):
        starts = [list(s.tokens) for s in seqs]
        emitted = dec.round(seqs)
        opened = next(sp for sp in tracer.spans if sp.kind == "verify")
        assert opened.extra == {"controlled": True}  # for the trace / metrics to mark
        verify = next(sp for sp in tracer.collect() if sp.kind == "verify")
        assert verify.accepted == [len(e) - 1 for e in emitted]
        accepted += verify.accepted
        for start, new in zip(starts, emitted):
            n = len(new) - 1
            assert new[:n] == generate(ref_draft, [start], n).token_ids[0]
            assert new[n:] == generate(ref_target, [start + new[:n]], 1).token_ids[0]
    assert len(set(accepted)) > 1


def test_statistics_are_counted_per_draft():
    s = SpecStats(k=3)
    s.record(3, 3)
    s.record(3, 1)
    s.record(2, 0)  # a sequence near its end proposes fewer
    s.record(0, 0)  # proposes nothing: not a draft
    assert (s.num_drafts, s.draft_tokens, s.accepted_tokens) == (3, 8, 4)
    assert s.acceptance_length == pytest.approx(1 + 4 / 3)
    assert s.acceptance_rate == pytest.approx(50.0)
    assert s.per_position_rates() == [2 / 3, 1 / 3, 1 / 2]  # position 2: proposed twice
    assert s.conditional_rates() == [2 / 3, 1 / 2, 1.0]
    d = s.as_dict()
    assert d["spec_decode_num_drafts"] == 3 and d["spec_decode_draft_tokens"] == 8
    assert d["spec_decode_accepted_tokens"] == 4
    assert d["spec_decode_per_position_acceptance_rates"] == s.per_position_rates()
    with pytest.raises(ValueError):
        s.record(2, 3)


def test_statistics_of_a_run_near_the_end_of_its_output():
    """One prompt, 10 new tokens, k = 4, a draft that always agrees: the prefill gives 1,
    round 1 proposes 4 (emits 5), round 2 may emit 4 so proposes 3 (all accepted)."""
    shape, hf = sm.weights()
    got = speculative_generate(sm.model(shape, hf), sm.model(shape, hf),
                               sm.prompts(96, [5]), 10, SpecConfig(k=4))
    d = got.stats.as_dict()
    assert len(got.token_ids[0]) == 10 and got.decode_steps == 2
    assert (d["spec_decode_num_drafts"], d["spec_decode_draft_tokens"],
            d["spec_decode_accepted_tokens"]) == (2, 7, 7)
    assert d["spec_decode_acceptance_length"] == pytest.approx(4.5)
    assert d["spec_decode_acceptance_rate"] == pytest.approx(100.0)
    assert d["spec_decode_per_position_acceptance_rates"] == [1.0, 1.0, 1.0, 1.0]
