"""The cupy backend: the torch reference backend with hot ops replaced by kernels/*.cu.

    be = CupyBackend("cuda", torch.bfloat16, options)   # one instance per model
    model = GraphModel(shape, weights, be)               # kestrel_rt/runner.py builds both

What an instance owns: its weight store and KV cache (from Backend), its compiled kernels
(`kernels`: KernelModules; `gemv`: the skinny matmuls, made when the model loads), its capture
stream and CUDA graph pool. Nothing is shared between instances, so a draft and a target
never see each other's weights or modules. Its settings are the RuntimeOptions it was built
with (kestrel_rt/options.py); nothing is set on it afterwards.

Ops that a kernel cannot take (fp16, prefill with M > MAX_KERNEL_M, head_dim not a multiple
of 8 in bf16, MoE batches over MAX_MOE_TOKENS tokens, quantized experts the expert-indexed
gemv cannot read) fall back to the TorchBackend op: same function, same shapes (with
moe_prefill_graphs, MoE calls past MAX_MOE_TOKENS on the capture-safe grouped matmul:
`routed_experts`).

The model's fused ops (kestrel_rt/backend/base.py) run as: `linear_add` with the residual
added in the gemv's epilogue; `rope_attention` with q/k norm + RoPE inside the decode
attention kernel; `norm_linear_swiglu` with the SwiGLU in the gate_up gemv's epilogue; a norm
whose weight is all ones (folded into the next linears: kestrel_rt/fold.py) as a row scale
inside the gemv or MoE kernels that read its output, with no rmsnorm launch; `moe_add` with
the residual inside moe_down (kestrel_rt/cuda/moe_layer.py); `greedy_tokens` (a greedy decode
step) by the lm_head's gemv or the argmax kernel, never writing fp32 logits
(kestrel_rt/cuda/greedy.py).
"""

from __future__ import annotations

import torch

from kestrel_rt import moe as moe_ref
from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.cuda import attention as attn_ops
from kestrel_rt.cuda import ops, reference
from kestrel_rt.cuda.gemv import Gemv, gemv_device
from kestrel_rt.cuda.greedy import GreedyHead
from kestrel_rt.cuda.module import KernelModules
from kestrel_rt.cuda.moe_layer import MoeKernels
from kestrel_rt.cuda.ops import Unsupported
from kestrel_rt.cuda.ring_probe import ring_streams_well
from kestrel_rt.options import OptionsError, RuntimeOptions, default_options
from kestrel_sim.models import ModelShape

MAX_KERNEL_M = 16  # decode / verify: M new tokens per sequence served by the attention kernel


def matmul_kind(name: str) -> str:
    """A weight's kind within its layer ("layers.3.o" -> "o"): what the gemv plan keys on."""
    return name.rsplit(".", 1)[-1]


class CupyBackend(TorchBackend):
    """TorchBackend with RMSNorm, q/k norm + RoPE, attention, SwiGLU, MoE, the linears and
    the greedy choice as CUDA kernels."""

    def __init__(self, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 options: RuntimeOptions | None = None):
        super().__init__(device, dtype)
        self.options = options or default_options(self.device, backend="cupy")
        if self.options.backend != "cupy":
            raise OptionsError(f"CupyBackend was given options for backend "
                               f"'{self.options.backend}': expected backend 'cupy'")
        self.kernels = KernelModules(self.device, pdl=self.options.pdl)  # KestrelError off CUDA
        if self.device.index is None:
            self.device = torch.device("cuda", self.kernels.device_index)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.capture_stream = torch.cuda.Stream(self.device)
        self.graph_pool = None  # torch.cuda.graph_pool_handle(), made on first capture
        self.gemv: Gemv | None = None  # made by load(): its plan depends on the model
        self.moe_kernels = MoeKernels(self)
        self.greedy_head = GreedyHead(self)
        self._unit_norms: set[str] = set()  # norm weights that are all ones (prepare_weight)
        self._graph_safe: dict[tuple[int, int], bool] = {}  # (batch, m) -> graph_safe's answer
        self._static_moe: bool | None = None  # static_moe's answer (the weights are fixed)

    def load(self, model_id: str, shape: ModelShape, hf_weights: dict) -> None:
        """Backend.load, after making the Gemv for this model: the bulk kernel's row-scale
        launches are kept off MoE models (slower there: docs/performance.md), and the ring
        kernel only where it streams well on this device (kestrel_rt/cuda/ring_probe.py; probed
        only where it would run: bf16 weights, no bulk kernel)."""
        o = self.options
        target = gemv_device(self.device, bulk=o.bulk_gemv, ring=o.ring_gemv,
                             bulk_rstd=not shape.is_moe)
        self.gemv = Gemv(self.device, target, pdl=o.pdl)
        ring_runs = o.ring_gemv and not o.bulk_gemv and self.dtype == torch.bfloat16
        if ring_runs and not ring_streams_well(self.gemv):
            self.gemv = Gemv(self.device, gemv_device(self.device, bulk=False, ring=False),
                             pdl=o.pdl)
        super().load(model_id, shape, hf_weights)

    def prepare_weight(self, name, tensor):
        if (tensor.dim() == 1 and (name == "norm" or name.endswith("_norm"))
                and bool((tensor == 1).all())):
            self._unit_norms.add(name)
        return super().prepare_weight(name, tensor)

    def is_unit_norm(self, name: str) -> bool:
        """True when norm weight `name` is all ones (folded): it runs as a row scale."""
        return name in self._unit_norms

    # -- which shapes run on kernels (and may be captured in a graph) ----------------------
    def kernel_dtype(self) -> bool:
        return self.dtype in ops.SUFFIX

    def graph_safe(self, batch: int, m: int) -> bool:
        """True when a forward of [batch, m] tokens runs only kernels and torch ops with no
        host sync, so it may be captured in a CUDA graph: decode and verify (m <= 16) on the
        kernels; a prefill (m > 16) of a dense model, whose attention is torch's over a Step
        of static length (the graph's step.max_ctx is the cache's max_len); a MoE prefill
        only with moe_prefill_graphs, where its experts run the capture-safe grouped path
        (static_moe; without it the torch experts may pick their tokens on the host). Asked
        before every forward of a GraphModel, so kept per shape (it depends only on the
        loaded model)."""
        safe = self._graph_safe.get((batch, m))
        if safe is None:
            safe = self._graph_safe[batch, m] = self._is_graph_safe(batch, m)
        return safe

    def _is_graph_safe(self, batch: int, m: int) -> bool:
        s = self.shape
        vec = 16 // torch.empty((), dtype=self.dtype).element_size()
        if not self.kernel_dtype() or s.head_dim % vec or s.head_dim > 256:
            return False
        if m > MAX_KERNEL_M:
            return not s.is_moe or (self.options.moe_prefill_graphs and self.static_moe())
        return not s.is_moe or self.moe_kernels.takes(batch * m)

    def static_moe(self) -> bool:
        """True when every MoE layer's experts run moe.static_experts_forward (torch's
        grouped matmul takes them: bf16, unquantized, compute capability 9.0+): then a MoE
        call the kernels do not take has no host sync and fixed shapes."""
        if self._static_moe is None:
            s = self.shape
            probe = torch.empty(1, s.hidden_size, device=self.device, dtype=self.dtype)
            self._static_moe = all(
                moe_ref.grouped_ok(probe, self.weight(f"layers.{i}.experts.gate_up"),
                                   self.weight(f"layers.{i}.experts.down"))
                for i in range(s.num_hidden_layers) if s.is_moe_layer(i))
        return self._static_moe

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
                                      min_keys=self.options.attention_min_keys,
                                      mma_verify=self.options.mma_verify,
                                      mma_decode=self._mma_decode(q.shape[0]))
        except Unsupported:
            return super().attention(q, k, v, layer, step)

    def _mma_decode(self, batch: int) -> bool:
        """Decode-shaped attention of this batch on attn_verify (RuntimeOptions)?"""
        least = self.options.mma_decode_min_batch
        return least is not None and batch >= least

    def rope_attention(self, q, k, v, layer, step):
        """q/k norm + RoPE inside the decode attention kernel (one launch fewer); where the
        decode rows go to the tensor-core kernel instead, the ops one after the other."""
        if q.shape[1] <= MAX_KERNEL_M and not self._mma_decode(q.shape[0]):
            try:
                return attn_ops.rope_attention(
                    self.kernels, q, k, v, self.weight(f"layers.{layer}.q_norm"),
                    self.weight(f"layers.{layer}.k_norm"), self._cos, self._sin,
                    self.kv.k[layer], self.kv.v[layer], step.slots, step.positions,
                    self.shape.rms_norm_eps, self.num_sms,
                    min_keys=self.options.attention_min_keys)
            except Unsupported:
                pass
        return super().rope_attention(q, k, v, layer, step)

    def linear(self, x, name):
        return self.gemv.linear(x, self.weight(name), matmul_kind(name))

    def _fused(self, x, name, **kw):
        """Gemv.fused of x and weight `name` (None where no kernel takes it)."""
        return self.gemv.fused(x, self.weight(name), matmul=matmul_kind(name), **kw)

    def norm_linear(self, x, norm, name):
        if self.is_unit_norm(norm):  # the norm as the gemv's row scale
            y = self._fused(x, name, rstd=True, eps=self.shape.rms_norm_eps)
            if y is not None:
                return y
        return super().norm_linear(x, norm, name)

    def linear_add(self, x, name, residual):
        y = self._fused(x, name, residual=residual)
        return super().linear_add(x, name, residual) if y is None else y

    def norm_linear_swiglu(self, x, norm, name):
        """The SwiGLU in the gate_up gemv's epilogue (and the norm as its row scale)."""
        if self.is_unit_norm(norm):
            y = self._fused(x, name, rstd=True, eps=self.shape.rms_norm_eps, glu=True)
            if y is not None:
                return y
        h = self.rms_norm(x, norm)
        y = self._fused(h, name, glu=True)
        return self.swiglu(self.linear(h, name)) if y is None else y

    def swiglu(self, gate_up):
        try:
            return ops.swiglu(self.kernels, gate_up, self.num_sms)
        except Unsupported:
            return super().swiglu(gate_up)

    def moe(self, x, layer):
        y = self.moe_kernels.run(x, layer, None)
        return super().moe(x, layer) if y is None else y

    def routed_experts(self, x, weights, experts, gate_up, down):
        """TorchBackend.routed_experts (a MoE call the kernels do not take); with
        moe_prefill_graphs, where static_moe, the capture-safe grouped path instead (the
        same sum, no host sync: a MoE prefill chunk can replay as a CUDA graph)."""
        if self.options.moe_prefill_graphs and self.static_moe():
            return moe_ref.static_experts_forward(x, weights, experts, gate_up, down)
        return super().routed_experts(x, weights, experts, gate_up, down)

    def moe_add(self, x, layer, residual):
        y = self.moe_kernels.run(x, layer, residual)
        return residual + super().moe(x, layer) if y is None else y

    def norm_moe_add(self, x, norm, layer):
        if self.is_unit_norm(norm):  # the norm as a row scale in the router and gate_up
            y = self.moe_kernels.run(x, layer, x, row_norm=True)
            if y is not None:
                return y
        return super().norm_moe_add(x, norm, layer)

    def greedy_tokens(self, x: torch.Tensor, out: torch.Tensor | None = None,
                      host: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Backend.greedy_tokens by the lm_head's gemv or the argmax kernel
        (kestrel_rt/cuda/greedy.py)."""
        return self.greedy_head.choose(x, out, host)

    def greedy_accept(self, draft: torch.Tensor, target: torch.Tensor):
        """draft [B, k], target argmax [B, k+1] int64 -> (accepted [B], next token [B])."""
        try:
            return ops.greedy_accept(self.kernels, draft, target)
        except Unsupported:
            return reference.greedy_accept(draft, target)
