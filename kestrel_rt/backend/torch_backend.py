"""The torch reference backend (CPU or CUDA): every op in plain torch, as transformers does.

Attention on the CPU reads each sequence's K/V rows of the cache in place (views, no copy).
A gather of every sequence's rows into one batch tensor copies B x T x Hkv x D values per
layer, K and V, every step; once that copy passes a few MB, glibc's malloc gets it fresh
pages from the kernel each time, and a page fault per 4 KB made a qwen3-0.6b draft step at
batch 4 and context 1024 several times its cost at context 128 (docs/performance.md;
tests/test_cpu_attention.py). On CUDA the batched gather stays: one shape per (B, M), as
graph capture needs.
"""

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
        B, M = q.shape[:2]
        rows = step.slots[:, None].expand(B, M)  # [B, M]
        kv.k[layer][rows, step.positions] = k
        kv.v[layer][rows, step.positions] = v
        if self.device.type == "cpu":
            return self.attention_in_place(q, layer, step)
        return self.attention_gathered(q, layer, step)

    def attention_gathered(self, q, layer, step):
        """`attention` after the cache write, in one batched call: every sequence's first
        max_ctx cache rows gathered into [B, Hkv, max_ctx, D] copies, a mask per row. q
        [B, M, Hq, D] -> [B, M, Hq, D]. Its shapes depend on (B, M) and max_ctx only (a
        static Step: max_len), which graph capture needs."""
        kv = self.kv
        Hq, D = q.shape[2:]
        Hkv = kv.k.shape[3]
        T = step.max_ctx
        keys = kv.k[layer][step.slots, :T].transpose(1, 2)  # [B, Hkv, T, D]
        values = kv.v[layer][step.slots, :T].transpose(1, 2)
        visible = torch.arange(T, device=q.device)[None, :] <= step.positions[:, :, None]
        out = F.scaled_dot_product_attention(  # [B, Hq, M, D]
            q.transpose(1, 2), keys, values, attn_mask=visible[:, None],  # mask [B, 1, M, T]
            scale=D**-0.5, enable_gqa=Hq != Hkv)
        return out.transpose(1, 2)  # [B, M, Hq, D]

    def attention_in_place(self, q, layer, step):
        """`attention` after the cache write, each sequence over its own cache rows read in
        place: q [B, M, Hq, D] -> [B, M, Hq, D]. Sequence b attends to keys 0..start[b] + M - 1
        (its rows past that are invisible to all its queries), row i to keys <= positions[b, i];
        the same masked softmax as attention_gathered, without its [B, Hkv, T, D] copies."""
        kv = self.kv
        M, Hq, D = q.shape[1:]
        Hkv = kv.k.shape[3]
        out = []
        for b, (slot, start) in enumerate(zip(step.slots.tolist(), step.start.tolist())):
            T = start + M
            keys = kv.k[layer, slot, :T].transpose(0, 1)[None]  # [1, Hkv, T, D], a view
            values = kv.v[layer, slot, :T].transpose(0, 1)[None]
            visible = None if M == 1 else (  # one token sees every cached key
                torch.arange(T, device=q.device)[None, :] <= step.positions[b][:, None])  # [M, T]
            out.append(F.scaled_dot_product_attention(  # [1, Hq, M, D]
                q[b:b + 1].transpose(1, 2), keys, values, attn_mask=visible, scale=D**-0.5,
                enable_gqa=Hq != Hkv))
        return torch.cat(out).transpose(1, 2)  # [B, M, Hq, D]

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
