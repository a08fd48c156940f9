"""Rejection sampling keeps the target's distribution exactly: the accept / resample function
on given p and q, and end to end on a tiny model (chi-square tests); per-request seeds."""

from __future__ import annotations

import math

import pytest
import spec_models as sm
import torch

from kestrel_rt.sampling import probabilities
from kestrel_rt.spec import SpecConfig, speculative_generate
from kestrel_rt.spec.accept import rejection_sample

Z = 4.0  # one-sided normal quantile of the chi-square tests' threshold (p ~ 3e-5)


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> tuple[bool, float, float]:
    """Pearson's chi-square of observed counts against probabilities (bins expecting fewer
    than 5 pooled into one): (passes, statistic, threshold by Wilson-Hilferty at Z)."""
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    assert (obs[~keep] == 0).all(), "a token the target never chooses was emitted"
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    df = int(keep.sum()) - 1
    threshold = df * (1 - 2 / (9 * df) + Z * math.sqrt(2 / (9 * df))) ** 3
    return stat < threshold, stat, threshold


def test_accept_and_resample_give_the_target_distribution():
    """k = 2 over a 6-token vocabulary: each emitted position is distributed as p, whatever
    q; the first acceptance rate is sum(min(p, q)); a zero of p is never emitted."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                      [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
                      [0.50, 0.10, 0.10, 0.10, 0.10, 0.10]])  # [k+1, V]
    q = torch.tensor([[0.10, 0.10, 0.10, 0.20, 0.30, 0.20],
                      [0.40, 0.20, 0.10, 0.10, 0.10, 0.10]])  # [k, V]
    N, k = 200_000, 2
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g)
                          for i in range(k)], 1)  # [N, k]
    limits = torch.full((N,), k)
    accepted, nxt = rejection_sample(p.expand(N, -1, -1), q.expand(N, -1, -1), drafts,
                                     torch.rand(N, k, generator=g), torch.rand(N, generator=g),
                                     limits)
    emitted = torch.cat([drafts, torch.zeros(N, 1, dtype=torch.long)], 1)  # [N, k+1]
    emitted.scatter_(1, accepted[:, None], nxt[:, None])  # d_1..d_n, then the next token
    rate0 = (accepted > 0).double().mean().item()
    assert rate0 == pytest.approx(torch.minimum(p[0], q[0]).sum().item(), abs=0.005)
    for i in range(k + 1):
        rows = accepted >= i  # rows that emitted position i
        ok, stat, limit = chi_square_ok(torch.bincount(emitted[rows, i], minlength=6), p[i])
        assert ok, f"position {i}: chi-square {stat:.1f} >= {limit:.1f}"
    # a sequence limited to fewer proposals: limit 0 draws from p_0, limit 1 bonus from p_1
    for lim in (0, 1):
        acc, tok = rejection_sample(p.expand(N, -1, -1), q.expand(N, -1, -1), drafts,
                                    torch.rand(N, k, generator=g), torch.rand(N, generator=g),
                                    torch.full((N,), lim))
        assert int(acc.max()) <= lim
        rows = acc == lim
        ok, stat, limit = chi_square_ok(torch.bincount(tok[rows], minlength=6), p[lim])
        assert ok, f"limit {lim}: chi-square {stat:.1f} >= {limit:.1f}"


def _marginals(target, prompt: list[int], temperature: float, top_p: float):
    """The target's exact distributions of generated tokens 2 and 3 after `prompt`, [V] each,
    from one forward over every 1- and 2-token continuation."""
    V = target.shape.vocab_size
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2]
    seqs = torch.cat([torch.tensor(prompt).expand(V * V, -1), pairs], 1)  # [V*V, P+2]
    target.allocate_kv(V * V, seqs.shape[1])
    logits = target.forward(seqs, list(range(V * V)))  # [V*V, P+2, V]
    probs = probabilities(logits.reshape(-1, V), temperature, top_p).view(logits.shape)
    P = len(prompt)
    p1 = probs[0, P - 1]  # [V] first token
    p2 = probs[::V, P].view(V, V)  # [t1, V]: rows whose t1 varies (t2 = 0 is irrelevant)
    p3 = probs[:, P + 1].view(V, V, V)  # [t1, t2, V]
    joint12 = p1[:, None] * p2  # [t1, t2]
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


@pytest.mark.parametrize("correction", ["fused", "separate"])
def test_speculative_sampling_keeps_the_target_distribution(correction):
    """3,000 sequences of one prompt, each with its own seed: tokens 2 and 3 (from the
    round: drafts accepted or resampled) follow the target's exact marginals."""
    shape, hf = sm.weights()
    # another random model: it agrees ~30% of the time, so the resampling from
    # max(0, p - q) matters (drawing from p instead fails token 2 here: chi-square ~310 > 140)
    target, draft = sm.model(shape, hf), sm.draft("other", shape, hf)
    prompt, N, T, top_p = [5, 17, 42, 8], 3000, 1.0, 0.9
    got = speculative_generate(target, draft, [prompt] * N, 3,
                               SpecConfig(k=2, temperature=T, top_p=top_p, seed=11,
                                          correction=correction))
    assert 10 < got.stats.acceptance_rate < 90  # some accepted, some resampled
    tokens = torch.tensor(got.token_ids)  # [N, 3]
    m2, m3 = _marginals(sm.model(shape, hf), prompt, T, top_p)
    for i, m in ((1, m2), (2, m3)):
        ok, stat, limit = chi_square_ok(torch.bincount(tokens[:, i], minlength=96), m)
        assert ok, f"token {i + 1}: chi-square {stat:.1f} >= {limit:.1f}"


@pytest.mark.parametrize("acceptance", [None, {"alpha": 0.5}])
def test_sampling_is_seeded_per_request_alone_or_batched(acceptance):
    shape, hf = sm.weights()
    target, draft = sm.model(shape, hf), sm.model(shape, sm.noisy(hf, 0.1))
    prompts = sm.prompts(shape.vocab_size, [3, 8, 5])

    def run(ps, seed):
        cfg = SpecConfig(k=3, temperature=0.9, top_p=0.95, seed=seed, acceptance=acceptance)
        return speculative_generate(target, draft, ps, 16, cfg).token_ids

    a = run(prompts, 123)
    assert a == run(prompts, 123)
    assert a != run(prompts, 124)
    for i, p in enumerate(prompts):  # request i samples with seed + i, alone or batched
        assert run([p], 123 + i)[0] == a[i]
