"""Judging a draft: greedy (the longest agreeing prefix) and lossless rejection sampling.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023), with p the target's and q the
draft's probabilities (both after temperature and top-p) and d_i ~ q_i the draft tokens:

- accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), as u_i * q < p with u_i ~ U[0, 1)
  (p >= q: always accepted); stop at the first rejection, n accepted;
- rejected at n: the next token is drawn from norm(max(0, p_n - q_n));
- all accepted: the bonus token is drawn from p_n, the same formula with q_n = 0.

Each emitted token is then distributed exactly as the target's. A sequence may judge fewer
than k positions (`limits`, near its end): positions at or past its limit count as not
proposed, so its bonus comes from p at its limit. Every draw takes a caller-supplied uniform,
so a sequence's tokens depend only on its own generator.
"""

from __future__ import annotations

import torch

from kestrel_rt.cuda import reference
from kestrel_rt.sampling import sample_from


def greedy_accept(backend, drafts: torch.Tensor, target_ids: torch.Tensor,
                  limits: torch.Tensor) -> torch.Tensor:
    """drafts [B, k], target argmax [B, k+1] int64, limits [B] -> accepted [B] int64 on the
    device: the longest prefix where they agree, at most limits[b]. Uses the backend's
    kernel where it has one (CupyBackend.greedy_accept), the torch reference otherwise."""
    judge = getattr(backend, "greedy_accept", reference.greedy_accept)
    accepted, _ = judge(drafts, target_ids)  # [B]
    return torch.minimum(accepted, limits)


def positions_below(limits: torch.Tensor, k: int) -> torch.Tensor:
    """limits [B] -> bool [B, k]: True where position i < limits[b] (proposed)."""
    return torch.arange(k, device=limits.device)[None, :] < limits[:, None]


def count_accepted(p_drafted: torch.Tensor, q_drafted: torch.Tensor, uniforms: torch.Tensor,
                   limits: torch.Tensor) -> torch.Tensor:
    """p_drafted, q_drafted [B, k]: target and draft probability of each draft token;
    uniforms [B, k] -> accepted [B]: draft tokens kept before the first rejection."""
    keep = (uniforms * q_drafted < p_drafted) & positions_below(limits, q_drafted.shape[1])
    return keep.long().cumprod(dim=1).sum(dim=1)  # [B]


def residual(p_next: torch.Tensor, q_next: torch.Tensor) -> torch.Tensor:
    """The distribution of the token after the accepted ones: p_next, q_next [B, V] (q_next
    zero for a bonus token) -> max(0, p - q) [B, V], unnormalised (sample_from scales by the
    total). Where rounding leaves nothing (p == q), p itself."""
    rest = (p_next - q_next).clamp_min(0.0)  # [B, V]
    empty = rest.sum(dim=-1, keepdim=True) <= 0  # [B, 1]
    return torch.where(empty, p_next, rest)


def draft_probs_at(q: torch.Tensor, accepted: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """q [B, k, V], accepted [B] -> q at position accepted[b] [B, V], zero where
    accepted[b] == limits[b] (all proposed tokens accepted: a bonus token)."""
    B, k, V = q.shape
    at = accepted.clamp(max=k - 1)[:, None, None].expand(B, 1, V)  # [B, 1, V]
    q_next = q.gather(1, at)[:, 0]  # [B, V]
    return q_next * (accepted < limits)[:, None].to(q_next)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                     u_accept: torch.Tensor, u_final: torch.Tensor,
                     limits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One round's judgement: p [B, k+1, V] target probabilities at [t0, d1..dk], q [B, k, V]
    draft probabilities, drafts [B, k] (d_i drawn from q_i), u_accept [B, k], u_final [B],
    limits [B] -> (accepted [B], next token [B]): the correction token after a rejection,
    the bonus token when all limits[b] proposed tokens were accepted."""
    idx = drafts[:, :, None]  # [B, k, 1]
    p_drafted = p[:, :-1].gather(2, idx)[:, :, 0]  # [B, k]
    q_drafted = q.gather(2, idx)[:, :, 0]  # [B, k]
    accepted = count_accepted(p_drafted, q_drafted, u_accept, limits)  # [B]
    V = p.shape[-1]
    p_next = p.gather(1, accepted[:, None, None].expand(-1, 1, V))[:, 0]  # [B, V]
    q_next = draft_probs_at(q, accepted, limits)  # [B, V]
    return accepted, sample_from(residual(p_next, q_next), u_final)
