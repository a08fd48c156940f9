"""The Backend interface: where and how one model's operations run, and what it owns.

A backend instance belongs to exactly ONE model (docs/architecture.md: a draft must never overwrite
its target's weights). `load()` refuses a second model; weights are stored under keys
`"{model_id}/{name}"` in a per-instance dict; nothing is global.

What a backend owns: its device and dtype, the packed weights (names in
kestrel_rt/packing.py), the KV cache (`allocate_kv`, kestrel_rt/kv_cache.py).

The model (kestrel_rt/model.py) calls only the ops below, per layer, on the residual
stream x:

    x = embed(tokens)                                   # [B, M, H]
    for layer i:
        qkv = norm_linear(x, "layers.{i}.input_norm", "layers.{i}.qkv")  # [B, M, (Hq+2Hkv) D]
        o = rope_attention(q, k, v, i, step)            # [B, M, Hq, D]; writes k, v to cache
        x = linear_add(o, "layers.{i}.o", x)            # x + o @ W_o.T
        dense: a = norm_linear_swiglu(x, "layers.{i}.post_norm", "layers.{i}.gate_up")
               x = linear_add(a, "layers.{i}.down", x)
        MoE:   x = norm_moe_add(x, "layers.{i}.post_norm", i)   # [N, H] rows
    logits = logits(x)                                  # norm + lm_head, fp32

The fused ops (norm_linear, norm_linear_swiglu, rope_attention, linear_add, moe_add,
norm_moe_add, logits) are compositions of the primitive ops (rms_norm, linear, qk_norm_rope, attention,
swiglu, moe) with the same rounding: the defaults here compose them, so the torch reference
only implements the primitives; a GPU backend runs each fused op as one kernel where it can
and falls back to the composition where it cannot.

HOW TO WRITE A SUBCLASS (e.g. the cupy backend): subclass `TorchBackend` (the reference)
and override any op with a kernel; un-overridden ops keep the torch reference, so each
kernel can be swapped in and checked alone (tests call the op on both backends with the
same inputs). Rules every op follows:
  * tensors in, tensors out, on `self.device`; activations in `self.dtype` except where
    noted (RMSNorm computes in fp32 and casts back, as transformers does; logits are fp32).
  * shapes are static for a given (B, M): decode and verify can be captured in CUDA graphs.
    `Step` (kv_cache.py) carries slots / start / n_new / positions as device tensors; its
    `max_ctx` is a host int that the torch reference uses to slice keys (a graph kernel
    may ignore it and read up to each sequence's length instead); `kv.step(..., static=True)`
    sets it to max_len so even the torch ops keep one shape. `Qwen3Model.compute(tokens,
    step)` is the device part of a forward (no host work) that a graph captures.
  * rows i >= step.n_new[b] are padding (ragged prefill): their outputs are unspecified, but
    they must never change valid rows. `attention` may write their K/V past the sequence's
    length (the model guarantees start + M <= max_len).
  * an op must not keep state between calls except the weight store and the KV cache.
  * `prepare_weight(name, tensor)` is the load-time hook: move to device, cast, repack,
    quantize (a quantized backend stores its own object and reads it back in `linear`).
    `weight(name)` returns what `prepare_weight` returned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kestrel_rt.kv_cache import KVCache, Step
from kestrel_rt.packing import pack_weights
from kestrel_sim.models import ModelShape


class BackendInUseError(RuntimeError):
    """A backend handed a second model: every model instance needs its own backend."""


class Backend(ABC):
    """One model's device, weight store and KV cache, and the ops its forward calls."""

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.dtype = dtype
        self.model_id: str | None = None
        self.shape: ModelShape | None = None
        self.kv: KVCache | None = None
        self._weights: dict[str, object] = {}

    # -- ownership and weights ---------------------------------------------------------
    def load(self, model_id: str, shape: ModelShape, hf_weights: dict[str, torch.Tensor]) -> None:
        """Take ownership of a model's weights (HF on-disk names); entries are popped."""
        if self.model_id is not None:
            raise BackendInUseError(
                f"backend already holds model '{self.model_id}'; model '{model_id}' needs its "
                "own backend instance (weights of two models must never share a store)"
            )
        self.model_id, self.shape = model_id, shape
        prepared: dict[int, object] = {}  # tied weights are prepared once, stored twice
        for name, tensor in pack_weights(shape, hf_weights).items():
            if id(tensor) not in prepared:
                prepared[id(tensor)] = self.prepare_weight(name, tensor)
            self._weights[self._key(name)] = prepared[id(tensor)]

    def _key(self, name: str) -> str:
        return f"{self.model_id}/{name}"

    def weight(self, name: str):
        """The stored weight `name` of this backend's model."""
        return self._weights[self._key(name)]

    def weight_names(self) -> list[str]:
        return list(self._weights)

    def prepare_weight(self, name: str, tensor: torch.Tensor):
        """Load-time hook: default moves to the device and casts to the backend dtype."""
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def allocate_kv(self, num_slots: int, max_len: int) -> KVCache:
        """A fresh KV cache of `num_slots` sequences of up to `max_len` tokens (replaces any)."""
        s = self.shape
        self.kv = KVCache(s.num_hidden_layers, num_slots, max_len, s.num_key_value_heads,
                          s.head_dim, self.device, self.dtype)
        return self.kv

    # -- ops ---------------------------------------------------------------------------
    @abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, M] int64 -> [B, M, H]."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x [..., n] -> weight[name] * (x / rms(x)) over the last dim, computed in fp32."""

    @abstractmethod
    def qk_norm_rope(
        self, q: torch.Tensor, k: torch.Tensor, layer: int, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm (layers.{layer}.q_norm / k_norm over D) then RoPE at
        step.positions. q [B, M, Hq, D], k [B, M, Hkv, D] (may be strided views of the qkv
        output) -> new tensors of the same shapes."""

    @abstractmethod
    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, step: Step
    ) -> torch.Tensor:
        """Write k, v [B, M, Hkv, D] into the cache at (layer, step.slots[b], positions[b, i]),
        then causal grouped-query attention of q [B, M, Hq, D] over cache entries
        0..positions[b, i] of slot b; softmax scale D**-0.5 -> [B, M, Hq, D]."""

    @abstractmethod
    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x [..., in] @ weight[name].T -> [..., out] (weight [out, in])."""

    @abstractmethod
    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2I] (gate then up) -> silu(gate) * up [..., I]."""

    @abstractmethod
    def moe(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Sparse MoE block of layer `layer`: x [N, H] -> [N, H]. Router softmax (fp32) over
        layers.{i}.router, top num_experts_per_tok, renormalised when norm_topk_prob, each
        token's chosen experts' SwiGLU MLPs (layers.{i}.experts.gate_up / .down) summed with
        those weights."""

    # -- fused ops: compositions of the ops above (same rounding); override with kernels ---
    def norm_linear(self, x: torch.Tensor, norm: str, name: str) -> torch.Tensor:
        """linear(rms_norm(x, norm), name): x [..., H] -> [..., out]."""
        return self.linear(self.rms_norm(x, norm), name)

    def linear_add(self, x: torch.Tensor, name: str, residual: torch.Tensor) -> torch.Tensor:
        """residual + linear(x, name) (the linear's output rounded to the dtype first)."""
        return residual + self.linear(x, name)

    def norm_linear_swiglu(self, x: torch.Tensor, norm: str, name: str) -> torch.Tensor:
        """swiglu(norm_linear(x, norm, name)): x [..., H] -> [..., I] (weight [2I, H], the gate
        rows then the up rows)."""
        return self.swiglu(self.norm_linear(x, norm, name))

    def rope_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                       step: Step) -> torch.Tensor:
        """attention(*qk_norm_rope(q, k, layer, step), v, layer, step): q, k not yet
        normalised or rotated (views of the qkv output) -> [B, M, Hq, D]."""
        q, k = self.qk_norm_rope(q, k, layer, step)
        return self.attention(q, k, v, layer, step)

    def moe_add(self, x: torch.Tensor, layer: int, residual: torch.Tensor) -> torch.Tensor:
        """residual + moe(x, layer): x, residual [N, H]."""
        return residual + self.moe(x, layer)

    def norm_moe_add(self, x: torch.Tensor, norm: str, layer: int) -> torch.Tensor:
        """moe_add(rms_norm(x, norm), layer, x): the MoE block on the residual stream x [N, H]."""
        return self.moe_add(self.rms_norm(x, norm), layer, x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm ("norm") + lm_head of the residual stream: x [B, M, H] -> [B, M, V]
        fp32."""
        return self.norm_linear(x, "norm", "lm_head").float()

    def greedy_tokens(self, x: torch.Tensor, out: torch.Tensor | None = None,
                      host: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The greedy choice at every position: argmax of logits(x), x [B, M, H] -> [B, M]
        int64 (the first index of the maximum, as torch.argmax), into `out` if given. host:
        (pinned int64 [2, B * M], parity int64 [1] on the device): the ids are also written to
        host[parity] by the device (the cupy backend; here unsupported)."""
        if host is not None:
            raise NotImplementedError(f"{type(self).__name__} cannot write token ids to the host "
                                      "from the device")
        tokens = self.logits(x).argmax(-1)
        return tokens if out is None else out.copy_(tokens)
