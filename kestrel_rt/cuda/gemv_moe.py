"""Qwen3-MoE experts through the expert-indexed gemv kernels (bf16, int8 or int4 experts).

    y = gemv_moe.moe(gemv, x, weights, experts, gate_up, down)

Each (token, chosen expert) pair is one row: `gemv_*_experts` kernels read the expert index
from device memory, so a routed layer needs no host sync and can be captured in a CUDA
graph, and only the experts a token picked are read (in their stored format: int4 experts
stream a quarter of the bytes). For decode and verify batches (T * k pairs, T small).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kestrel_rt.cuda.linear import (
    Gemv,
    _i,
    _output,
    _p,
    default_variant,
    experts_name,
)
from kestrel_rt.quant_weights import Int4Weight, Int8Weight


def file_of(w) -> str:
    """The kernels/ file whose kernels read weight `w`."""
    if isinstance(w, Int8Weight):
        return "gemv_int8"
    if isinstance(w, Int4Weight):
        return "gemv_int4"
    return "gemv"


def experts(gemv: Gemv, x: torch.Tensor, w, ids: torch.Tensor, x_div: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """y[p] = x[p // x_div] @ W[ids[p]].T for each of P pairs -> [P, N] bf16.

    x [R, K] bf16 contiguous; w [E, N, K]: a bf16 tensor, Int8Weight or Int4Weight;
    ids [P] int64 on the device (read by the kernel).
    """
    file = file_of(w)
    _, n, k = w.shape
    pairs = ids.numel()
    y = _output(out, pairs, n, x.device)
    variant = default_variant(file, n, k, max(1, gemv.sms // max(pairs, 1)))
    if isinstance(w, Int8Weight):
        args = (_p(w.q), _p(w.scales), _p(x), _p(y))
    elif isinstance(w, Int4Weight):
        args = (_p(w.qweight_t), _p(w.qzeros), _p(w.scales), _p(x), _p(y))
    else:
        args = (_p(w), _p(x), _p(y))
    args += (_p(ids), _i(x_div), _i(n), _i(k))
    grid = (math.ceil(n / (16 * variant[1])), pairs)
    gemv.launch(file, experts_name(file, variant), grid, (32 * variant[0] * variant[1],), args)
    return y


def supports(x: torch.Tensor, gate_up, down) -> bool:
    """True when moe() takes these: bf16 tokens [T, H], 3-D expert weights the kernels read."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2):
        return False
    for w in (gate_up, down):
        if w.dim() != 3:
            return False
        n, k = w.shape[1], w.shape[2]
        if isinstance(w, Int8Weight):
            ok = k % 16 == 0 and w.q.is_contiguous()
        elif isinstance(w, Int4Weight):
            ok = k % 128 == 0 and n % 8 == 0 and w.qweight_t.is_contiguous()
        else:
            ok = (isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16
                  and w.is_contiguous() and k % 8 == 0)
        if not ok:
            return False
    return True


def moe(gemv: Gemv, x: torch.Tensor, weights: torch.Tensor, experts_: torch.Tensor, gate_up,
        down) -> torch.Tensor:
    """x [T, H], weights [T, k], experts [T, k] int64, gate_up [E, 2I, H], down [E, H, I]
    -> [T, H]: SwiGLU of each chosen expert (torch), weighted and summed in fp32."""
    t, top_k = experts_.shape
    ids = experts_.reshape(-1).contiguous()  # [T * k]
    h = experts(gemv, x.contiguous(), gate_up, ids, top_k)  # [T * k, 2I]
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()  # [T * k, I]
    y = experts(gemv, act, down, ids, 1)  # [T * k, H]
    mixed = (y.view(t, top_k, -1).float() * weights.float()[..., None]).sum(1)  # [T, H]
    return mixed.to(x.dtype)
