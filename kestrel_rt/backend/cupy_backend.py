"""The cupy backend: the torch reference backend with hot ops replaced by kernels/*.cu.

    be = CupyBackend("cuda", torch.bfloat16)      # one instance per model
    model = Qwen3Model(shape, weights, be)         # or GraphModel (kestrel_rt/cuda/graphs.py)

What an instance owns: its weight store and KV cache (from Backend), its compiled kernels
(`self.kernels`, a KernelModules), its capture stream and CUDA graph pool. Nothing is shared
between instances, so a draft and a target never see each other's weights or modules.

Ops that a kernel cannot take (fp16, prefill with M > MAX_KERNEL_M, head_dim not a multiple
of 8 in bf16, MoE batches over MAX_MOE_TOKENS tokens, quantized experts the expert-indexed
gemv cannot read) fall back to the TorchBackend op: same function, same shapes. Quantized
(int8 / int4) experts run through kestrel_rt/cuda/gemv_moe.py after the routing kernel.
`linear` comes from GemvLinear (the skinny bf16 / int8 / int4 matmul kernels, falling back
to torch for other dtypes and wide inputs).

The model's fused ops (kestrel_rt/backend/base.py) run as: `linear_add` with the residual
added in the gemv's epilogue, `rope_attention` with q/k norm + RoPE inside the attention
kernel, `moe_add` with the residual inside moe_down, `norm_linear_swiglu` with the SwiGLU in
the gate_up gemv's epilogue (`glu_epilogue`, on); `norm_linear` and `norm_linear_swiglu` fold
the RMSNorm into the gemv prologue when `fuse_prologues` is on (off: measured slower), or,
when its weight is all ones (folded into the linear: kestrel_rt/fold.py) and
`norm_row_scale` says so ("all", the default: in the bf16 gemvs' epilogue and in the router
gemv and moe_gate_up; "moe": only a MoE layer's post-attention norm), apply it as a row
scale. `pdl` launches every kernel of the forward with programmatic dependent launch.
"""

from __future__ import annotations

import torch

from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.cuda import attention as attn_ops
from kestrel_rt.cuda import gemv_moe, ops, reference
from kestrel_rt.cuda.linear import GemvLinear
from kestrel_rt.cuda.module import KernelModules
from kestrel_rt.cuda.ops import Unsupported
from kestrel_rt.quant_weights import QuantizedWeight

MAX_KERNEL_M = 16  # decode / verify: M new tokens per sequence served by the attention kernel
MAX_MOE_TOKENS = 64  # tokens per MoE call served by the per-(token, expert) GEMV kernels


class CupyBackend(GemvLinear, TorchBackend):
    """TorchBackend with RMSNorm, q/k norm + RoPE, attention, SwiGLU, MoE as CUDA kernels,
    and `linear` through the gemv kernels (kestrel_rt/cuda/linear.py: bf16, int8, int4 for
    <= 16 rows; cuBLAS otherwise)."""

    def __init__(self, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 pdl: bool = True):
        """pdl: launch the kernels with programmatic dependent launch where they support it
        (kestrel_rt/cuda/pdl.py): each may start while the previous one finishes."""
        super().__init__(device, dtype)
        self.pdl = pdl
        self.kernels = KernelModules(self.device, pdl=pdl)  # KestrelError off CUDA / no cupy
        if self.device.index is None:
            self.device = torch.device("cuda", self.kernels.device_index)
        props = torch.cuda.get_device_properties(self.device)
        self.num_sms = props.multi_processor_count
        self.capture_stream = torch.cuda.Stream(self.device)
        self.graph_pool = None  # torch.cuda.graph_pool_handle(), made on first capture
        self._quant_experts_ok: bool | None = None  # gemv_moe takes the stored experts
        self.bf16_experts = "kernel"  # bf16 MoE experts: "kernel" (moe.cu) or "gemv"
        # RMSNorm inside the gemv prologue (norm_linear). With the SwiGLU prologue in the down
        # gemv as well it measured slower on the H200 (bench/ablation.py: qwen3-8b bf16 5.24 vs
        # 5.04 ms, int4 3.93 vs 2.75 ms per step): off by default
        self.fuse_prologues = False
        # Which RMSNorms whose weight is all ones (kestrel_rt/fold.py folded it into the next
        # linears) run as a per-row scale inside the kernels that read their output, with no
        # rmsnorm launch: "all" (before qkv, gate_up, the router and moe_gate_up, lm_head),
        # "moe" (only a MoE layer's post-attention norm) or "none". H200, bench/ablation.py:
        # qwen3-30b-a3b bf16 with every norm folded 2.883 ms per step, with the MoE norms
        # folded 2.975, none 3.101; a dense model gains nothing (qwen3-8b bf16 every norm
        # folded 4.578 vs 4.512 ms), so fold_for_speed folds MoE models only
        self.norm_row_scale = "all"
        # moe_down issues its first weight loads before its PDL wait, while moe_gate_up
        # finishes (kernels/moe.cu): qwen3-30b-a3b bf16 2.883 vs 2.941 ms per step
        self.moe_early = True
        self._unit_norms: set[str] = set()  # norm weights that are all ones (prepare_weight)
        # keys per context split of the decode attention kernel, at least (attn_ops.attention)
        self.decode_min_keys = attn_ops.DECODE_MIN_KEYS
        # SwiGLU in the gate_up gemv's epilogue (one launch fewer per dense layer; exact
        # rounding): faster everywhere on the H200 (bench/ablation.py: qwen3-8b bf16 4.98 vs
        # 5.04 ms, int4 2.70 vs 2.75, qwen3-0.6b 0.877 vs 0.909 ms per step)
        self.glu_epilogue = True

    NORM_ROW_SCALES = ("all", "moe", "none")

    @property
    def norm_row_scale(self) -> str:
        return self._norm_row_scale

    @norm_row_scale.setter
    def norm_row_scale(self, value: str) -> None:
        if value not in self.NORM_ROW_SCALES:
            raise ValueError(f"CupyBackend.norm_row_scale must be one of "
                             f"{', '.join(self.NORM_ROW_SCALES)}, not {value!r}")
        self._norm_row_scale = value

    # -- which shapes run on kernels (and may be captured in a graph) ----------------------
    def kernel_dtype(self) -> bool:
        return self.dtype in ops.SUFFIX

    def graph_safe(self, batch: int, m: int) -> bool:
        """True when a forward of [batch, m] tokens runs only kernels and torch ops with no
        host sync and no host-side bound (the torch attention slices keys to step.max_ctx),
        so it may be captured in a CUDA graph."""
        s = self.shape
        vec = 16 // torch.empty((), dtype=self.dtype).element_size()
        if not self.kernel_dtype() or m > MAX_KERNEL_M or s.head_dim % vec or s.head_dim > 256:
            return False
        return not s.is_moe or self._moe_kernel_ok(batch * m)

    def _moe_kernel_ok(self, tokens: int) -> bool:
        s = self.shape
        if tokens > MAX_MOE_TOKENS or s.num_experts > ops.MAX_MOE_EXPERTS:
            return False
        if not 0 < s.num_experts_per_tok <= 32:
            return False
        vec = 16 // torch.empty((), dtype=self.dtype).element_size()
        if s.hidden_size % vec or s.moe_intermediate_size % vec:
            return False
        for i in range(s.num_hidden_layers):
            if s.is_moe_layer(i):
                w = (self.weight(f"layers.{i}.experts.gate_up"),
                     self.weight(f"layers.{i}.experts.down"))
                if any(isinstance(t, QuantizedWeight) for t in w):
                    return self._quantized_experts_ok(*w)
                return all(type(t) is torch.Tensor and t.is_contiguous() for t in w)
        return True

    def _quantized_experts_ok(self, gate_up, down) -> bool:
        """True when gemv_moe reads these int8 / int4 experts with [T, hidden] tokens in
        this backend's dtype (bf16 only); decided once per instance (its weights are fixed)."""
        if self._quant_experts_ok is None:
            probe = torch.empty(1, self.shape.hidden_size, device=self.device, dtype=self.dtype)
            self._quant_experts_ok = gemv_moe.supports(probe, gate_up, down)
        return self._quant_experts_ok

    # -- ops -------------------------------------------------------------------------------
    def rms_norm(self, x, name):
        try:
            return ops.rms_norm(self.kernels, x, self.weight(name), self.shape.rms_norm_eps)[0]
        except Unsupported:
            return super().rms_norm(x, name)

    def qk_norm_rope(self, q, k, layer, step):
        try:
            return ops.qk_norm_rope(
                self.kernels, q, k, self.weight(f"layers.{layer}.q_norm"),
                self.weight(f"layers.{layer}.k_norm"), self._cos, self._sin, step.positions,
                self.shape.rms_norm_eps)
        except Unsupported:
            return super().qk_norm_rope(q, k, layer, step)

    def attention(self, q, k, v, layer, step):
        if q.shape[1] > MAX_KERNEL_M:  # prefill: torch's fused attention over the cache
            return super().attention(q, k, v, layer, step)
        kc, vc = self.kv.k[layer], self.kv.v[layer]  # [slots, max_len, Hkv, D]
        try:
            return attn_ops.attention(self.kernels, q, k, v, kc, vc, step.slots,
                                      step.positions, self.num_sms,
                                      min_keys=self.decode_min_keys)
        except Unsupported:
            return super().attention(q, k, v, layer, step)

    def rope_attention(self, q, k, v, layer, step):
        """q/k norm + RoPE inside the decode attention kernel (one launch fewer)."""
        if q.shape[1] <= MAX_KERNEL_M:
            try:
                return attn_ops.rope_attention(
                    self.kernels, q, k, v, self.weight(f"layers.{layer}.q_norm"),
                    self.weight(f"layers.{layer}.k_norm"), self._cos, self._sin,
                    self.kv.k[layer], self.kv.v[layer], step.slots, step.positions,
                    self.shape.rms_norm_eps, self.num_sms, min_keys=self.decode_min_keys)
            except Unsupported:
                pass
        return super().rope_attention(q, k, v, layer, step)

    def prepare_weight(self, name, tensor):
        if (tensor.dim() == 1 and (name == "norm" or name.endswith("_norm"))
                and bool((tensor == 1).all())):
            self._unit_norms.add(name)
        return super().prepare_weight(name, tensor)

    def _rstd_gemv(self, x, norm, name, glu: bool = False):
        """norm_linear (+ SwiGLU epilogue) with the norm as the gemv's row scale, or None."""
        if not (self.norm_row_scale == "all" and norm in self._unit_norms):
            return None
        return self.gemv().fused(x, self.weight(name), rstd=True, eps=self.shape.rms_norm_eps,
                                 glu=glu)

    # -- fused gemv ops: prologue (RMSNorm / SwiGLU) and residual epilogue in the kernel ----
    def norm_linear(self, x, norm, name):
        y = self._rstd_gemv(x, norm, name)
        if y is not None:
            return y
        if not self.fuse_prologues:
            return super().norm_linear(x, norm, name)
        y = self.gemv().fused(x, self.weight(name), norm=self.weight(norm),
                              eps=self.shape.rms_norm_eps)
        return super().norm_linear(x, norm, name) if y is None else y

    def linear_add(self, x, name, residual):
        y = self.gemv().fused(x, self.weight(name), residual=residual)
        return super().linear_add(x, name, residual) if y is None else y

    def norm_linear_swiglu(self, x, norm, name):
        if self.glu_epilogue:  # the SwiGLU in the gate_up gemv's epilogue
            y = self._rstd_gemv(x, norm, name, glu=True)
            if y is not None:
                return y
            w, eps = self.weight(name), self.shape.rms_norm_eps
            if self.fuse_prologues:
                y = self.gemv().fused(x, w, norm=self.weight(norm), eps=eps, glu=True)
            else:
                y = self.gemv().fused(self.rms_norm(x, norm), w, glu=True)
            if y is not None:
                return y
        return super().norm_linear_swiglu(x, norm, name)

    def swiglu(self, gate_up):
        try:
            return ops.swiglu(self.kernels, gate_up, self.num_sms)
        except Unsupported:
            return super().swiglu(gate_up)

    def moe(self, x, layer):
        y = self._moe_kernels(x, layer, None)
        return super().moe(x, layer) if y is None else y

    def moe_add(self, x, layer, residual):
        y = self._moe_kernels(x, layer, residual)
        return residual + super().moe(x, layer) if y is None else y

    def norm_moe_add(self, x, norm, layer):
        if self.norm_row_scale in ("moe", "all") and norm in self._unit_norms:  # a row scale
            y = self._moe_kernels(x, layer, x, row_norm=True)
            if y is not None:
                return y
        return super().norm_moe_add(x, norm, layer)

    def _moe_kernels(self, x, layer, residual, row_norm: bool = False):
        """Routing kernel, then the experts: bf16 experts through kernels/moe.cu (or the
        expert-indexed gemv when self.bf16_experts == "gemv"), int8 / int4 experts through
        kestrel_rt/cuda/gemv_moe.py; + residual when given. row_norm: x is not normalised
        yet, its RMSNorm has a unit weight (folded: kestrel_rt/fold.py) and becomes a row
        scale in the router gemv and in moe_gate_up (bf16 kernel experts only). None when the
        kernels cannot take it (the caller runs the torch reference)."""
        s = self.shape
        if not (self.kernel_dtype() and self._moe_kernel_ok(x.shape[0])):
            return None  # (quantized experts pass only when gemv_moe reads them)
        gate_up = self.weight(f"layers.{layer}.experts.gate_up")  # [E, 2I, H]
        down = self.weight(f"layers.{layer}.experts.down")  # [E, H, I]
        use_gemv = (isinstance(gate_up, QuantizedWeight) or isinstance(down, QuantizedWeight)
                    or (self.bf16_experts == "gemv" and gemv_moe.supports(x, gate_up, down)))
        if row_norm and use_gemv:
            return None
        eps = s.rms_norm_eps if row_norm else None
        router = f"layers.{layer}.router"
        try:
            logits = (self.gemv().fused(x, self.weight(router), rstd=True, eps=eps) if row_norm
                      else self.linear(x, router))  # [N, E]
            if logits is None:
                return None
            weights, experts = ops.moe_route(self.kernels, logits, s.num_experts_per_tok,
                                             s.norm_topk_prob)  # [N, k] each
            if use_gemv:
                return gemv_moe.moe(self.gemv(), x, weights, experts, gate_up, down,
                                    residual=residual)  # [N, H]
            return ops.moe_experts(self.kernels, x, weights, experts, gate_up, down,
                                   residual=residual, row_eps=eps, early=self.moe_early)
        except Unsupported:
            return None

    # -- speculative decoding ----------------------------------------------------------------
    def greedy_accept(self, draft: torch.Tensor, target: torch.Tensor):
        """draft [B, k], target argmax [B, k+1] int64 -> (accepted [B], next token [B])."""
        try:
            return ops.greedy_accept(self.kernels, draft, target)
        except Unsupported:
            return reference.greedy_accept(draft, target)


def cupy_model(shape, weights: dict, device: str | torch.device = "cuda",
               dtype: torch.dtype = torch.bfloat16, graphs: bool = True, model_id=None):
    """A Qwen3 model on its own CupyBackend: GraphModel (decode / verify replay CUDA graphs)
    or, with graphs=False, a plain Qwen3Model. What `kestrel generate --backend cupy` builds."""
    from kestrel_rt.cuda.graphs import GraphModel
    from kestrel_rt.model import Qwen3Model

    cls = GraphModel if graphs else Qwen3Model
    return cls(shape, weights, CupyBackend(device, dtype), model_id=model_id)
