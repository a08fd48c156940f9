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
gemv and moe_gate_up; "moe": only a MoE layer's post-attention norm; "producer": the residual
gemvs of `linear_add` write their output's sums of squares and the next gemv takes its rstd
from them; measured slower), apply it as a row scale, or, with `ring_norm` (off: measured
slower), inside the ring gemv's staging of x. `moe_fused_route` (off: measured
slower) routes inside moe_gate_up, without the moe_route launch. `pdl` launches every kernel
of the forward with programmatic dependent launch. `greedy_tokens` (a greedy decode step,
Qwen3Model.forward(..., greedy=True)) takes the argmax inside the lm_head's bulk gemv at
batch 1-2 (Gemv.argmax), else in kernels/argmax.cu, never writing fp32 logits.
"""

from __future__ import annotations

import torch

from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.cuda import attention as attn_ops
from kestrel_rt.cuda import gemv_moe, ops, reference
from kestrel_rt.cuda.gemv_variants import BULK_AFTER_ATTENTION, GLU, MAX_ROWS, RMSNORM
from kestrel_rt.cuda.linear import GemvLinear, file_of
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
        # "moe" (only a MoE layer's post-attention norm), "producer" or "none". H200,
        # bench/ablation.py: qwen3-30b-a3b bf16 with every norm folded 2.883 ms per step, with
        # the MoE norms folded 2.975, none 3.101; qwen3-0.6b bf16 0.787 vs 0.837, but qwen3-8b
        # bf16 4.578 vs 4.512 ms (slower) with the tuned kernels' row scale; with the bulk
        # kernel's (Gemv.bulk_rstd, sm_90) 4.210 vs 4.243-4.252, so fold_for_speed folds every
        # float model there, MoE and small dense models elsewhere.
        # "producer" (slower on the H200: qwen3-8b bf16 4.569, int4 2.416, qwen3-0.6b 0.799 ms
        # against 4.574, 2.340, 0.789 with "all", bench/results/
        # ablation_producer_moe_route_h200.log): linear_add's gemv also writes the sums of
        # squares of its output per 16-column tile (ssq_out) and the norm_linear /
        # norm_linear_swiglu right after it takes its rstd from them (ssq_in: no squares of x
        # in that gemv); a unit norm without such a producer (layer 0's input norm, the final
        # norm after a gather) runs the rmsnorm kernel; a MoE layer's post-attention norm is a
        # row scale as in "moe"
        self.norm_row_scale = "all"
        # "producer": the sums-of-squares buffers per (rows, width) (kept: fixed addresses, so
        # a captured CUDA graph replays with them) and what the last linear_add wrote: (its
        # output's data_ptr, shape, its buffer) or None. See _producer_ssq.
        self._ssq_bufs: dict[tuple[int, int], torch.Tensor] = {}
        self._ssq_last: tuple | None = None
        # argmax_scratch per (rows, vocab) of greedy_tokens (fixed addresses, as _ssq_bufs)
        self._argmax_bufs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        # Gemv.argmax's (keys, count) per rows of x (greedy_tokens in the lm_head's gemv)
        self._argmax_state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.ssq_consumed = 0  # gemvs that took their rstd from a producer (tests count them)
        # moe_down issues its first weight loads before its PDL wait, while moe_gate_up
        # finishes (kernels/moe.cu): qwen3-30b-a3b bf16 2.883 vs 2.941 ms per step
        self.moe_early = True
        # moe_route inside moe_gate_up (ops.moe_experts_routed: one launch fewer per MoE
        # layer); with moe_early, moe_down routes again from the logits before its wait and
        # issues its early loads, without it reads moe_gate_up's routing after its wait.
        # Kernel experts (moe.cu) only. Slower on the H200 (qwen3-30b-a3b bf16 3.121 vs 2.894
        # ms per step, bench/results/ablation_producer_moe_route_h200.log): off
        self.moe_fused_route = False
        self._unit_norms: set[str] = set()  # norm weights that are all ones (prepare_weight)
        # keys per context split of the decode attention kernel, at least (attn_ops.attention)
        self.decode_min_keys = attn_ops.DECODE_MIN_KEYS
        # SwiGLU in the gate_up gemv's epilogue (one launch fewer per dense layer; exact
        # rounding): faster everywhere on the H200 (bench/ablation.py: qwen3-8b bf16 4.98 vs
        # 5.04 ms, int4 2.70 vs 2.75, qwen3-0.6b 0.877 vs 0.909 ms per step)
        self.glu_epilogue = True
        # the RMSNorm before a linear done by the ring gemv as it stages x (kernels/
        # gemv_ring.cu: once per block, no rmsnorm launch) wherever the ring kernel takes the
        # launch (bf16 weights at M <= 8 by default). Slower on the H200 (bench/ablation.py
        # --ring-norm 0,1: qwen3-8b bf16 4.266 vs 4.201 ms per step, int4 2.239 vs 2.227): off
        self.ring_norm = False
        # measure on first use whether the bf16 ring gemvs stream about as fast as the tuned
        # kernels on this device, and keep them only then (Gemv.settle_ring; one H200 streamed
        # them at 63% of copy against 89%). Nothing to measure while the Gemv's bulk kernel
        # is set (the default on sm_90: it takes the ring's launches)
        self.settle_ring = True
        # bulk settings (WARPS, S, C) by matmul kind (qkv, o, gate_up, down, lm_head) instead
        # of the Gemv's `bulk` for that kind's fused bf16 launches (_fused, and the lm_head's
        # greedy argmax); None: the measured default
        # (default_kind_bulk: the o projection's deeper ring where it has more tiles than SMs)
        self.kind_bulk: dict[str, tuple[int, int, int]] | None = None

    def gemv(self):
        """GemvLinear.gemv; a MoE model's row-scale launches (rstd) stay on the tuned kernels
        (Gemv.bulk_rstd off): H200, qwen3-30b-a3b bf16 2.826-2.830 ms per step through the bulk
        kernel against 2.752 (bench/results/ablation_bulk_rstd_h200.log), where qwen3-8b and
        qwen3-0.6b gain from it."""
        made = getattr(self, "_gemv", None) is None
        g = super().gemv()
        if made and self.shape is not None and self.shape.is_moe:
            g.bulk_rstd = False
        return g

    NORM_ROW_SCALES = ("all", "moe", "none", "producer")

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
    def embed(self, tokens):
        self._ssq_last = None  # a new forward: nothing produced yet
        return super().embed(tokens)

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

    def default_kind_bulk(self, rows: int) -> dict[str, tuple[int, int, int]]:
        """kind_bulk's default for the loaded model and `rows` rows of x: at one row (batch-1
        decode), BULK_AFTER_ATTENTION for the o projection where its weight has more 16-row
        tiles than this GPU has SMs (gemv_variants.py says what was measured; at two rows the
        H200 decode step was 5.218 ms with it against 4.382 without), nothing else."""
        s = self.shape
        if rows != 1 or s is None or -(-s.hidden_size // 16) <= self.num_sms:
            return {}
        return {"o": BULK_AFTER_ATTENTION}

    def _bulk_of(self, name: str, x: torch.Tensor) -> tuple[int, int, int] | None:
        """The bulk setting for the launch of weight `name` on x [..., K] (its kind's in
        kind_bulk, or the default for x's rows), or None: the Gemv's. kind_bulk names bf16
        bulk variants: an int8 / int4 weight's launches keep their Gemv's own setting (an
        int4 kernel has other compiled variants, Gemv.bulk_int4)."""
        kinds = self.kind_bulk
        if kinds is None:
            kinds = self.default_kind_bulk(x.numel() // x.shape[-1] if x.shape[-1] else 0)
        setting = kinds.get(name.rsplit(".", 1)[-1])
        if setting is None or file_of(self.weight(name)) != "gemv":
            return None
        return setting

    def _fused(self, x, name, **kw):
        """Gemv.fused of x and weight `name`, at the bulk setting of its kind (_bulk_of)."""
        return self.gemv().fused(x, self.weight(name), bulk=self._bulk_of(name, x), **kw)

    def prepare_weight(self, name, tensor):
        if (tensor.dim() == 1 and (name == "norm" or name.endswith("_norm"))
                and bool((tensor == 1).all())):
            self._unit_norms.add(name)
        return super().prepare_weight(name, tensor)

    def _rstd_gemv(self, x, norm, name, glu: bool = False):
        """norm_linear (+ SwiGLU epilogue) with the norm as the gemv's row scale, or None:
        from the producer's sums of squares ("producer"), or per chunk in the gemv ("all")."""
        ssq = self._producer_ssq(x, norm)
        if ssq is not None:
            y = self._fused(x, name, ssq_in=ssq, eps=self.shape.rms_norm_eps, glu=glu)
            if y is not None:
                self.ssq_consumed += 1
                return y
        if not (self.norm_row_scale == "all" and norm in self._unit_norms):
            return None
        return self._fused(x, name, rstd=True, eps=self.shape.rms_norm_eps, glu=glu)

    # norm_row_scale "producer". Invariant: a consumer gemv reads the sums of squares that
    # the last linear_add wrote only when its x is exactly the tensor that linear_add's gemv
    # wrote, in the same forward, unmodified since: the same data_ptr and shape (checked
    # here), and nothing writes into it in between (Qwen3Model.compute: a linear_add output
    # is read by one norm op next, otherwise only as a residual). The record is taken by the
    # first norm op after it (matching or not) and cleared by embed and by every linear_add,
    # so a tensor that later reuses the freed address never matches a stale record.
    def _producer_ssq(self, x, norm):
        """The float32 sums of squares [M, ceil(H / 16)] of x's rows written by the last
        linear_add, or None (no producer, another tensor, not a unit norm, another mode)."""
        last, self._ssq_last = self._ssq_last, None
        if last is None or self.norm_row_scale != "producer" or norm not in self._unit_norms:
            return None
        ptr, shape, ssq = last
        if x.data_ptr() != ptr or tuple(x.shape) != shape or not x.is_contiguous():
            return None
        return ssq

    def _ssq_buffer(self, residual):
        """"producer": the sums-of-squares buffer [rows, ceil(N / 16)] of a linear_add onto
        residual [..., N] (one per (rows, N), kept); None in other modes and for more rows
        than the gemvs take."""
        n = residual.shape[-1]
        rows = residual.numel() // n
        if self.norm_row_scale != "producer" or not 0 < rows <= MAX_ROWS:
            return None
        buf = self._ssq_bufs.get((rows, n))
        if buf is None:
            buf = torch.empty(rows, -(-n // 16), device=residual.device, dtype=torch.float32)
            self._ssq_bufs[(rows, n)] = buf
        return buf

    # -- fused gemv ops: prologue (RMSNorm / SwiGLU) and residual epilogue in the kernel ----
    def _ring_norm_gemv(self, x, norm, name, glu: bool = False):
        """act(x) @ W.T with act the RMSNorm by weight `norm`, inside a persistent gemv (the
        bulk kernel's or the ring's staging of x: ring_norm), or None where neither takes it."""
        if not self.ring_norm:
            return None
        rows, file = x.numel() // x.shape[-1], file_of(self.weight(name))
        pro = RMSNORM | (GLU if glu else 0)
        g = self.gemv()
        if not (g.takes_bulk(file, pro, rows, x.shape[-1], self._bulk_of(name, x))
                or g.takes_ring(file, pro, rows, x.shape[-1])):
            return None
        return self._fused(x, name, norm=self.weight(norm), eps=self.shape.rms_norm_eps, glu=glu)

    def norm_linear(self, x, norm, name):
        y = self._rstd_gemv(x, norm, name)
        if y is None:
            y = self._ring_norm_gemv(x, norm, name)
        if y is not None:
            return y
        if not self.fuse_prologues:
            return super().norm_linear(x, norm, name)
        y = self._fused(x, name, norm=self.weight(norm), eps=self.shape.rms_norm_eps)
        return super().norm_linear(x, norm, name) if y is None else y

    def linear_add(self, x, name, residual):
        self._ssq_last = None
        ssq = self._ssq_buffer(residual)  # "producer": the output's sums of squares too
        y = self._fused(x, name, residual=residual, ssq_out=ssq)
        if y is None:
            return super().linear_add(x, name, residual)
        if ssq is not None:
            self._ssq_last = (y.data_ptr(), tuple(y.shape), ssq)
        return y

    def norm_linear_swiglu(self, x, norm, name):
        if self.glu_epilogue:  # the SwiGLU in the gate_up gemv's epilogue
            y = self._rstd_gemv(x, norm, name, glu=True)
            if y is None:
                y = self._ring_norm_gemv(x, norm, name, glu=True)
            if y is not None:
                return y
            if self.fuse_prologues:
                y = self._fused(x, name, norm=self.weight(norm), eps=self.shape.rms_norm_eps,
                                glu=True)
            else:
                y = self._fused(self.rms_norm(x, norm), name, glu=True)
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
        self._ssq_last = None  # (a MoE layer reads no producer's sums of squares)
        if (self.norm_row_scale in ("moe", "all", "producer")
                and norm in self._unit_norms):  # a row scale
            y = self._moe_kernels(x, layer, x, row_norm=True)
            if y is not None:
                return y
        return super().norm_moe_add(x, norm, layer)

    def _moe_kernels(self, x, layer, residual, row_norm: bool = False):
        """Routing kernel, then the experts: bf16 experts through kernels/moe.cu (or the
        expert-indexed gemv when self.bf16_experts == "gemv"), int8 / int4 experts through
        kestrel_rt/cuda/gemv_moe.py; + residual when given. row_norm: x is not normalised
        yet, its RMSNorm has a unit weight (folded: kestrel_rt/fold.py) and becomes a row
        scale in the router gemv and in moe_gate_up (bf16 kernel experts only).
        moe_fused_route: kernel experts (moe.cu) route inside moe_gate_up, no routing kernel
        (ops.moe_experts_routed). None when the kernels cannot take it (the caller runs the
        torch reference)."""
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
            logits = (self._fused(x, router, rstd=True, eps=eps) if row_norm
                      else self.linear(x, router))  # [N, E]
            if logits is None:
                return None
            if self.moe_fused_route and not use_gemv:
                return ops.moe_experts_routed(self.kernels, x, logits, s.num_experts_per_tok,
                                              s.norm_topk_prob, gate_up, down,
                                              residual=residual, row_eps=eps,
                                              early=self.moe_early)  # [N, H]
            weights, experts = ops.moe_route(self.kernels, logits, s.num_experts_per_tok,
                                             s.norm_topk_prob)  # [N, k] each
            if use_gemv:
                return gemv_moe.moe(self.gemv(), x, weights, experts, gate_up, down,
                                    residual=residual)  # [N, H]
            return ops.moe_experts(self.kernels, x, weights, experts, gate_up, down,
                                   residual=residual, row_eps=eps, early=self.moe_early)
        except Unsupported:
            return None

    # -- greedy sampling ---------------------------------------------------------------------
    def greedy_tokens(self, x: torch.Tensor, out: torch.Tensor | None = None,
                      host: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The choice inside the lm_head's bulk gemv where it takes the shape
        (_greedy_in_lm_head), else argmax of the lm_head's bf16 output by kernels/argmax.cu:
        either way over the bf16 logits, whose fp32 widening `logits` returns, so the choice
        is the same, without the fp32 copy. host: the kernel also writes the ids to
        host[parity] (ops.argmax, Gemv.argmax)."""
        chosen = self._greedy_in_lm_head(x, out, host)
        if chosen is not None:
            return chosen
        h = self.norm_linear(x, "norm", "lm_head")  # [B, M, V]
        V = h.shape[-1]
        rows = h.numel() // V if V else 0
        try:
            scratch = self._argmax_bufs.get((rows, V))
            if scratch is None:  # kept: a captured graph replays with the same buffers
                scratch = ops.argmax_scratch(rows, V, h.device)
                self._argmax_bufs[(rows, V)] = scratch
            return ops.argmax(self.kernels, h, scratch, out, host)  # [B, M]
        except Unsupported:
            if host is not None:
                raise
            tokens = h.float().argmax(-1)
            return tokens if out is None else out.copy_(tokens)

    def _greedy_in_lm_head(self, x: torch.Tensor, out: torch.Tensor | None,
                           host: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """greedy_tokens by the lm_head's bulk gemv itself (Gemv.argmax: no logits written,
        no argmax launch), where it computes what norm_linear would (the final norm folded
        and applied as its row scale, or the rmsnorm kernel before a plain gemv); None
        (nothing launched) elsewhere. x [B, M, H] -> [B, M] int64."""
        norm, w = "norm", self.weight("lm_head")
        unit = norm in self._unit_norms
        if unit and self.norm_row_scale != "all":
            return None  # a unit norm that norm_linear does not apply as a row scale
        if self.ring_norm or self.fuse_prologues or (out is not None and not out.is_contiguous()):
            return None
        x2 = x.reshape(-1, x.shape[-1])  # [rows, H]
        gemv = self.gemv()
        bulk = self._bulk_of("lm_head", x)
        if not gemv.takes_argmax(x2, w, unit, bulk):
            return None
        if not unit:
            x2 = self.rms_norm(x2, norm)
        rows = x2.shape[0]
        state = self._argmax_state.get(rows)
        if state is None:  # kept: a captured graph replays with the same buffers
            state = (torch.zeros(rows, dtype=torch.long, device=x.device),
                     torch.zeros(1, dtype=torch.int32, device=x.device))
            self._argmax_state[rows] = state
        dest = (torch.empty(rows, dtype=torch.long, device=x.device) if out is None
                else out.view(rows))
        gemv.argmax(x2, w, rstd=unit, eps=self.shape.rms_norm_eps, state=state, out=dest,
                    host=host, bulk=bulk)
        return dest.view(x.shape[:-1])

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
