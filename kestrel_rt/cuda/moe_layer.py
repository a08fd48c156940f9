"""A Qwen3-MoE layer's routed experts on the GPU, for one backend (decode and verify batches).

    y = moe.run(x, layer, residual, row_norm)     # [N, H], or None: use the torch reference

The router's gemv, then the routing kernel (kernels/moe.cu moe_route: top-k of the softmax),
then the experts: bf16 experts through moe.cu's moe_gate_up / moe_down (one warp per output,
the residual added in moe_down, moe_down's first weight loads issued before its PDL wait),
int8 / int4 experts through the expert-indexed gemvs (kestrel_rt/cuda/gemv_moe.py: only the
experts a token picked are read, in their stored format). No host sync anywhere, so a MoE
forward can be captured in a CUDA graph. row_norm: x is the raw residual stream and its
RMSNorm has a unit weight (folded into the router and gate_up: kestrel_rt/fold.py), applied
as a row scale in the router gemv and in moe_gate_up (bf16 kernel experts only).
"""

from __future__ import annotations

import torch

from kestrel_rt.cuda import gemv_moe, ops
from kestrel_rt.cuda.ops import Unsupported
from kestrel_rt.quant_weights import weight_kind

MAX_MOE_TOKENS = 64  # tokens per MoE call served by the per-(token, expert) kernels


class MoeKernels:
    """The routed-expert kernels of one backend (its weights, KernelModules and Gemv)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._quantized_ok: bool | None = None  # gemv_moe takes the stored experts

    def takes(self, tokens: int) -> bool:
        """True when the kernels take a MoE call of `tokens` tokens for this model."""
        be = self.backend
        s = be.shape
        if (tokens > MAX_MOE_TOKENS or s.num_experts > ops.MAX_MOE_EXPERTS
                or not 0 < s.num_experts_per_tok <= 32):
            return False
        vec = 16 // torch.empty((), dtype=be.dtype).element_size()
        if s.hidden_size % vec or s.moe_intermediate_size % vec:
            return False
        for i in range(s.num_hidden_layers):
            if s.is_moe_layer(i):
                w = self._experts(i)
                if any(weight_kind(t) in ("int8", "int4") for t in w):
                    return self._quantized_experts_ok(*w)
                return all(type(t) is torch.Tensor and t.is_contiguous() for t in w)
        return True

    def _experts(self, layer: int):
        be = self.backend
        return (be.weight(f"layers.{layer}.experts.gate_up"),  # [E, 2I, H]
                be.weight(f"layers.{layer}.experts.down"))  # [E, H, I]

    def _quantized_experts_ok(self, gate_up, down) -> bool:
        """True when gemv_moe reads these int8 / int4 experts with [T, hidden] tokens in the
        backend's dtype (bf16 only); decided once (the weights are fixed)."""
        if self._quantized_ok is None:
            be = self.backend
            probe = torch.empty(1, be.shape.hidden_size, device=be.device, dtype=be.dtype)
            self._quantized_ok = gemv_moe.supports(probe, gate_up, down)
        return self._quantized_ok

    def run(self, x: torch.Tensor, layer: int, residual: torch.Tensor | None,
            row_norm: bool = False) -> torch.Tensor | None:
        """Routed experts of `layer` on x [N, H] (+ residual [N, H]) -> [N, H], or None when
        the kernels cannot take it (the caller runs the torch reference)."""
        be = self.backend
        s = be.shape
        if not (be.kernel_dtype() and self.takes(x.shape[0])):
            return None
        gate_up, down = self._experts(layer)
        quantized = any(weight_kind(t) in ("int8", "int4") for t in (gate_up, down))
        if row_norm and quantized:
            return None
        eps = s.rms_norm_eps if row_norm else None
        router = f"layers.{layer}.router"
        try:
            if row_norm:
                logits = be.gemv.fused(x, be.weight(router), rstd=True, eps=eps,
                                       matmul="router")  # [N, E]
                if logits is None:
                    return None
            else:
                logits = be.linear(x, router)  # [N, E]
            weights, experts = ops.moe_route(be.kernels, logits, s.num_experts_per_tok,
                                             s.norm_topk_prob)  # [N, k] each
            if quantized:
                return gemv_moe.moe(be.gemv, x, weights, experts, gate_up, down,
                                    residual=residual)  # [N, H]
            return ops.moe_experts(be.kernels, x, weights, experts, gate_up, down,
                                   residual=residual, row_eps=eps)  # [N, H]
        except Unsupported:
            return None
