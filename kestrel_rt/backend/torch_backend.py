"""The torch reference backend (CPU or CUDA): every op in plain torch, as transformers does."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel_rt import moe as moe_ref
from kestrel_rt.backend.base import Backend
from kestrel_rt.kv_cache import KVCache
from kestrel_rt.rope import apply_rope, cos_sin, inv_freq


class TorchBackend(Backend):
    """Reference implementation of every op; subclasses override ops with kernels."""

    def allocate_kv(self, num_slots: int, max_len: int) -> KVCache:
        kv = super().allocate_kv(num_slots, max_len)
        # RoPE tables [max_len, D]: same fp32 products as computing them per position.
        inv_f = inv_freq(self.shape.head_dim, self.shape.rope_theta, self.device)
        positions = torch.arange(max_len, device=self.device)
        self._cos, self._sin = cos_sin(positions, inv_f, self.dtype)
        return kv

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight("embed"))  # [B, M, H]

    def rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        y = xf * torch.rsqrt(var + self.shape.rms_norm_eps)
        return self.weight(name) * y.to(x.dtype)

    def qk_norm_rope(self, q, k, layer, step):
        q = self.rms_norm(q, f"layers.{layer}.q_norm")  # [B, M, Hq, D]
        k = self.rms_norm(k, f"layers.{layer}.k_norm")  # [B, M, Hkv, D]
        cos, sin = self._cos[step.positions], self._sin[step.positions]  # [B, M, D]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attention(self, q, k, v, layer, step):
        kv = self.kv
        B, M, Hq, D = q.shape
        Hkv = k.shape[2]
        rows = step.slots[:, None].expand(B, M)  # [B, M]
        kv.k[layer][rows, step.positions] = k
        kv.v[layer][rows, step.positions] = v
        T = step.max_ctx
        keys = kv.k[layer][step.slots, :T].transpose(1, 2)  # [B, Hkv, T, D]
        values = kv.v[layer][step.slots, :T].transpose(1, 2)
        visible = torch.arange(T, device=q.device)[None, :] <= step.positions[:, :, None]
        out = F.scaled_dot_product_attention(  # [B, Hq, M, D]
            q.transpose(1, 2), keys, values, attn_mask=visible[:, None],  # mask [B, 1, M, T]
            scale=D**-0.5, enable_gqa=Hq != Hkv)
        return out.transpose(1, 2)  # [B, M, Hq, D]

    def linear(self, x, name):
        return F.linear(x, self.weight(name))

    def swiglu(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def moe(self, x, layer):
        s = self.shape
        weights, experts = moe_ref.route(
            x, self.weight(f"layers.{layer}.router"), s.num_experts_per_tok, s.norm_topk_prob)
        return self.routed_experts(
            x, weights, experts,
            self.weight(f"layers.{layer}.experts.gate_up"),
            self.weight(f"layers.{layer}.experts.down"))

    def routed_experts(self, x, weights, experts, gate_up, down):
        """The chosen experts' weighted SwiGLU sum (kestrel_rt/moe.py experts): x [N, H];
        weights, experts [N, k]; gate_up [E, 2I, H]; down [E, H, I] -> [N, H]."""
        return moe_ref.experts(x, weights, experts, gate_up, down)
