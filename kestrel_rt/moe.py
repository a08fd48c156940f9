"""Qwen3-MoE sparse block in plain torch: router softmax, top-k, optional renorm, experts.

`experts` picks the experts' path: `grouped_experts_forward` (one grouped matmul per
projection over the tokens sorted by expert, no host sync: a 512-token prefill of
qwen3-30b-a3b no longer loops over 128 experts per layer with a host read each, which took
over a second per forward on an H200) where torch's grouped matmul takes the weights, else
the per-expert loop `experts_forward` (quantized experts, other GPUs). The grouped path,
`static_experts_forward` (the same function), is written so a CUDA graph can capture it
(the cupy backend's RuntimeOptions.moe_prefill_graphs calls it directly): every shape fixed
by the token count and top-k, no op that reads a device value on the host; eagerly,
`experts` falls back to the loop where the grouped matmul refuses a call."""

from __future__ import annotations

import warnings

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


def grouped_ok(x: torch.Tensor, gate_up, down) -> bool:
    """True when torch._grouped_mm takes these experts and tokens: plain tensors (not
    quantized), on the CPU, or bf16 on a GPU of compute capability 9 or more (where its
    CUDA kernel runs) with rows of whole 16-byte vectors."""
    if not (hasattr(torch, "_grouped_mm") and type(gate_up) is torch.Tensor
            and type(down) is torch.Tensor and gate_up.dtype == down.dtype == x.dtype):
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    aligned = x.shape[-1] % 8 == 0 and down.shape[-1] % 8 == 0
    return aligned and torch.cuda.get_device_capability(x.device)[0] >= 9


def experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up,
            down) -> torch.Tensor:
    """The chosen experts' weighted SwiGLU sum by the fastest path that takes them (see the
    module docstring): x [N, H] -> [N, H]."""
    if grouped_ok(x, gate_up, down):
        try:
            return grouped_experts_forward(x, weights, chosen, gate_up, down)
        except RuntimeError as err:  # a layout or size this torch's kernel refuses
            warnings.warn(f"MoE experts: torch._grouped_mm refused the call ({err}); "
                          "running the per-expert loop", RuntimeWarning, stacklevel=2)
    return experts_forward(x, weights, chosen, gate_up, down)


def static_experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    grouped_mm=None,
) -> torch.Tensor:
    """experts_forward's weighted sum with no host sync (the same products, added in the
    same order: a token's experts in ascending id, the loop's and transformers' rounding),
    in a form a CUDA graph can capture: every shape depends only on N and k, and no op reads
    a device value on the host (no .item / .tolist / nonzero / unique / bincount / boolean
    index), nor falls back to the loop (a grouped matmul that refuses raises; `experts`
    catches that eagerly).

    - each token's k choices sorted by expert id (the order its sum adds them in);
    - the N*k (token, choice) rows sorted by expert on the device (a stable argsort), so each
      expert's rows are contiguous and in token order;
    - each expert's end row: a scatter_add count and a cumsum, [E] int32 on the device (an
      expert no token picked is an empty group);
    - one grouped matmul per projection over all N*k rows: the groups' total is N*k however
      the tokens split, so no group is padded to a bound;
    - the rows back in token order by a gather through the inverse permutation (a scatter
      of arange), weighted, summed over the k choices.

    grouped_mm(a [R, K], b [E, K, J], offs [E] int32) -> [R, J]: torch._grouped_mm where
    None (a test passes a loop). x [N, H]; weights, experts [N, k]; gate_up [E, 2I, H];
    down [E, H, I] -> [N, H]."""
    if grouped_mm is None:
        grouped_mm = torch._grouped_mm
    n, k = experts.shape
    num_experts = gate_up.shape[0]
    chosen, by_id = experts.sort(dim=1)  # [N, k] each token's experts in id order
    chosen_weights = weights.gather(1, by_id)  # [N, k]
    flat = chosen.reshape(-1)  # [N*k] row j*k + c: token j's c-th expert
    order = torch.argsort(flat, stable=True)  # [N*k] rows by expert, tokens ascending
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)  # [E]
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each expert's group
    rank = torch.arange(n * k, device=x.device)  # [N*k]
    inverse = torch.empty_like(order).scatter_(0, order, rank)  # [N*k] row -> its sorted place
    rows = x.index_select(0, order // k)  # [N*k, H]
    h = grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)  # [N*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    h = grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)  # [N*k, H]
    parts = h.index_select(0, inverse).view(n, k, -1) * chosen_weights[..., None]  # [N, k, H]
    out = parts[:, 0]
    for j in range(1, k):
        out = out + parts[:, j]  # [N, H]
    return out


# the eager path's name for it (experts picks it where the grouped matmul takes the weights)
grouped_experts_forward = static_experts_forward
