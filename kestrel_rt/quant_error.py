"""How far a quantized model's logits are from its unquantized self (issue 4: report the
logits error of int8 / int4 against bf16).

Both models see the same prompts in one prefill forward; the numbers are over every position.
"""

from __future__ import annotations

import torch

from kestrel_rt.model import Qwen3Model


def prefill_logits(model: Qwen3Model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a fresh prefill of `tokens` [B, M] -> [B, M, V] (fp32)."""
    batch, length = tokens.shape
    model.allocate_kv(batch, length)
    slots = [model.kv.allocate() for _ in range(batch)]
    return model.forward(tokens.to(model.device), slots).float()


def logits_error(reference: Qwen3Model, quantized: Qwen3Model, tokens: torch.Tensor) -> dict:
    """rel_error = ||q - ref|| / ||ref||, max_abs, and the share of positions whose argmax
    (greedy next token) agrees, over the prefill logits of `tokens` [B, M]."""
    ref = prefill_logits(reference, tokens)  # [B, M, V]
    got = prefill_logits(quantized, tokens)  # [B, M, V]
    return {
        "rel_error": ((got - ref).norm() / ref.norm()).item(),
        "max_abs": (got - ref).abs().max().item(),
        "argmax_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "positions": tokens.numel(),
    }
