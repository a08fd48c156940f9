"""Rotary position embedding as in transformers' Qwen3 (default rope type, rotate-half form)."""

from __future__ import annotations

import torch


def inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies theta^(-2i/head_dim)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim
    return 1.0 / (theta ** exponents)


def cos_sin(
    positions: torch.Tensor, inv_f: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for integer positions [...]: each [..., head_dim], computed in fp32."""
    freqs = positions[..., None].float() * inv_f  # [..., head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, M, heads, D], cos/sin [B, M, D] -> rotated x, same shape and dtype."""
    cos = cos[:, :, None, :]  # [B, M, 1, D]
    sin = sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin
