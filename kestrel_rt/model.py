"""Qwen3 / Qwen3-MoE forward over a backend: M new tokens per sequence against the KV cache."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from kestrel_rt.backend.base import Backend
from kestrel_rt.kv_cache import KVCache, Step
from kestrel_sim.errors import KestrelError
from kestrel_sim.models import ModelShape


@dataclass
class Chosen:
    """Greedy token ids of a forward (Qwen3Model.forward_greedy): `tokens` on the model's
    device (the next decode step's input), `host` the same on the host once `ready` has
    passed (None: already there)."""

    tokens: torch.Tensor  # [B, M] int64 ([B] with last_only) on the model's device
    host: torch.Tensor  # the same shape on the host
    ready: torch.cuda.Event | None

    @classmethod
    def copy_back(cls, tokens: torch.Tensor) -> Chosen:
        """Start copying device token ids to the host (pinned, asynchronous)."""
        if not tokens.is_cuda:
            return cls(tokens, tokens, None)
        host = tokens.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(tokens, host, ready)

    def read(self) -> list:
        """The ids as (nested) Python lists, waiting for their step if it is still running."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class Qwen3Model:
    """Qwen3ForCausalLM / Qwen3MoeForCausalLM inference, exact against transformers.

    `weights` uses Hugging Face on-disk names (see kestrel_rt/packing.py); the backend takes
    ownership (entries are popped from the dict). One backend per model instance.
    """

    def __init__(
        self, shape: ModelShape, weights: dict[str, torch.Tensor], backend: Backend,
        model_id: str | None = None,
    ) -> None:
        if shape.num_attention_heads % shape.num_key_value_heads:
            raise KestrelError(
                f"model '{shape.name}': num_attention_heads={shape.num_attention_heads} is not a "
                f"multiple of num_key_value_heads={shape.num_key_value_heads}"
            )
        self.shape = shape
        self.backend = backend
        self.model_id = model_id or f"{shape.name}-{uuid.uuid4().hex[:12]}"
        backend.load(self.model_id, shape, weights)

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def kv(self) -> KVCache:
        if self.backend.kv is None:
            raise RuntimeError("no KV cache: call model.allocate_kv(num_slots, max_len) first")
        return self.backend.kv

    def allocate_kv(self, num_slots: int, max_len: int) -> KVCache:
        """A fresh KV cache in this model's backend (replaces any earlier one)."""
        return self.backend.allocate_kv(num_slots, max_len)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, slots: list[int], n_new: list[int] | None = None,
        last_only: bool = False, greedy: bool = False,
    ) -> torch.Tensor:
        """Run M new tokens per sequence and append them to the cache.

        tokens [B, M] int64 (row b belongs to KV slot slots[b]); n_new[b] <= M of them are
        real (the rest padding, default all M). Advances each slot's length by n_new[b].
        Returns fp32 logits [B, M, V], or [B, V] at each row's last real token if last_only;
        greedy: their argmax instead, int64 [B, M] (or [B]), computed on the device.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        B, M = tokens.shape
        n_new = [M] * B if n_new is None else list(n_new)
        step = self.kv.step(list(slots), M, n_new)
        out = self.compute(tokens, step, last_only, greedy)  # [B, M or 1, V] or [B, M or 1]
        self.kv.advance(list(slots), n_new)
        return out[:, 0] if last_only else out

    def forward_greedy(self, tokens: torch.Tensor, slots: list[int],
                       n_new: list[int] | None = None, last_only: bool = False) -> Chosen:
        """forward(..., greedy=True) with the ids on their way to the host: what an
        overlapped decode loop needs (enqueue the next step with `tokens`, then `read()`
        this one)."""
        return Chosen.copy_back(self.forward(tokens, slots, n_new, last_only, greedy=True))

    def compute(self, tokens: torch.Tensor, step: Step, last_only: bool = False,
                greedy: bool = False, out: torch.Tensor | None = None,
                host: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The device work of `forward` for a prepared Step: no host sync, nothing outside
        the backend's ops, so a CUDA graph can capture it (kestrel_rt/cuda/graphs.py).

        tokens [B, M] int64 on the device -> fp32 logits [B, M, V] ([B, 1, V] if last_only),
        or with greedy their argmax, int64 [B, M] ([B, 1]), written into `out` if given
        (and into pinned host memory by the device: Backend.greedy_tokens' `host`).
        """
        be, s = self.backend, self.shape
        B, M = tokens.shape
        D, Hq, Hkv = s.head_dim, s.num_attention_heads, s.num_key_value_heads

        def attend(qkv: torch.Tensor, layer: int) -> torch.Tensor:  # [B, M, (Hq+2Hkv) D]
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            o = be.rope_attention(q.view(B, M, Hq, D), k.view(B, M, Hkv, D),
                                  v.view(B, M, Hkv, D), layer, step)  # [B, M, Hq, D]
            return o.reshape(B, M, Hq * D)

        x = self.layers(be.embed(tokens), attend)  # [B, M, H]: the residual stream
        if last_only:
            last = (step.n_new - 1)[:, None, None].expand(B, 1, x.shape[-1])  # [B, 1, H]
            x = x.gather(1, last)
        if greedy:
            return be.greedy_tokens(x, out, host)  # [B, M or 1]
        return be.logits(x)  # [B, M or 1, V]

    def layers(self, x: torch.Tensor, attend) -> torch.Tensor:
        """Every decoder layer on the residual stream x [..., H] (any leading dims: [B, M]
        for one batch, [1, T] for a packed one: kestrel_rt/packed.py); attend(qkv, layer)
        turns the layer's qkv [..., (Hq+2Hkv) D] into attention output [..., Hq D]."""
        be, s = self.backend, self.shape
        for i in range(s.num_hidden_layers):
            qkv = be.norm_linear(x, f"layers.{i}.input_norm", f"layers.{i}.qkv")
            x = be.linear_add(attend(qkv, i), f"layers.{i}.o", x)
            if s.is_moe_layer(i):
                x = be.norm_moe_add(x.reshape(-1, x.shape[-1]), f"layers.{i}.post_norm",
                                    i).view(x.shape)  # [N, H] rows
            else:
                act = be.norm_linear_swiglu(x, f"layers.{i}.post_norm",
                                            f"layers.{i}.gate_up")  # [..., I]
                x = be.linear_add(act, f"layers.{i}.down", x)
        return x

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Append each prompt to its (typically empty) slot in one padded batch.

        Returns fp32 logits [B, V] at each prompt's last token.
        """
        tokens, lengths = padded(prompts)  # [B, M]
        return self.forward(tokens, slots, lengths, last_only=True)


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Token rows of different lengths -> ([B, M] int64, 0-padded, on the host; lengths)."""
    lengths = [len(r) for r in rows]
    M = max(lengths)
    return torch.tensor([r + [0] * (M - len(r)) for r in rows], dtype=torch.long), lengths
