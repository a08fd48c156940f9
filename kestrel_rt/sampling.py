"""Next-token choice from logits: greedy, or temperature + top-p sampling by inverse CDF.

Sampling takes one uniform number per sequence (drawn by the caller from that sequence's
own seeded generator), so a sequence samples the same tokens alone or in any batch, and
the same uniforms serve rejection sampling in speculative decoding later.
"""

from __future__ import annotations

import torch

SEED_RANGE = 2**64  # torch.Generator.manual_seed takes 0 .. 2**64 - 1


def request_generator(seed: int | None, request: int) -> torch.Generator:
    """Request `request`'s CPU generator: seeded (seed + request) mod 2**64, or at random
    when seed is None."""
    g = torch.Generator()
    g.manual_seed((seed + request) % SEED_RANGE) if seed is not None else g.seed()
    return g


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] int64, the first index of the maximum (as torch.argmax)."""
    return logits.argmax(dim=-1)


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """logits [B, V] -> fp32 probabilities [B, V] after temperature and top-p (nucleus).

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (always at
    least the most likely one) and renormalises over it.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # [B, V]
        drop_sorted = mass_before >= top_p  # first column is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [B, V], uniforms [B] in [0, 1) -> [B] int64."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    target = (uniforms.to(cdf) * cdf[:, -1])[:, None]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]  # [B]
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # never return a zero-probability token (fp edge at a plateau of the cdf)
    bad = probs.gather(1, idx[:, None])[:, 0] <= 0
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(dim=-1), idx)
    return idx


def choose(
    logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor | None
) -> torch.Tensor:
    """Greedy at temperature 0, else a top-p sample: logits [B, V] -> [B] int64."""
    if temperature == 0:
        return greedy(logits)
    return sample_from(probabilities(logits, temperature, top_p), uniforms)
