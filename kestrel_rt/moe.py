"""Qwen3-MoE sparse block in plain torch: router softmax, top-k, optional renorm, experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H], router [E, H] -> (weights [N, top_k] in x.dtype, experts [N, top_k] int64).

    Softmax in fp32 over all experts, then top-k, then (optionally) renormalise the k
    weights to sum to one, as transformers' Qwen3MoeTopKRouter does.
    """
    logits = F.linear(x, router)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [N, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Weighted sum of the chosen experts' SwiGLU MLPs.

    x [N, H]; weights, experts [N, k]; gate_up [E, 2I, H] (gate rows then up rows);
    down [E, H, I] -> [N, H]. Loops over the experts that were hit (reference, not fast).
    """
    out = torch.zeros_like(x)  # [N, H]
    hit = torch.unique(experts).tolist()
    for e in hit:
        token_idx, kth = torch.where(experts == e)  # [n_e] each
        h = F.linear(x[token_idx], gate_up[e])  # [n_e, 2I]
        gate, up = h.chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down[e])  # [n_e, H]
        h = h * weights[token_idx, kth, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out
