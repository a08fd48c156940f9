"""Torch references for kernels that have no TorchBackend op (runs anywhere, CPU in CI)."""

from __future__ import annotations

import torch


def greedy_accept(draft: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest agreeing prefix: draft [B, k], target argmax [B, k+1] int64 ->
    (accepted [B] = largest n with draft[:, :n] == target[:, :n], next [B] = target[b, n])."""
    k = draft.shape[1]
    agree = (draft == target[:, :k]).long()  # [B, k]
    accepted = agree.cumprod(dim=1).sum(dim=1)  # [B]
    nxt = target.gather(1, accepted[:, None])[:, 0]  # [B]
    return accepted, nxt
