"""A mixed step's forwards: as serving runs them today, and packed in one pass.

    outs = forward_mixed(model, rows, chunks)    # what serving and calibration run

`forward_mixed` runs the decode (or verify) rows, then each prompt chunk, each its own
forward: on a GraphModel each is a CUDA-graph replay (an eager forward is bound by the
host), so this is what kestrel_rt/serve/forward.py runs and what `kestrel calibrate`
measures as a mixed step. `forward_packed` below runs all of them in ONE pass over the
weights; eager (it is not captured in graphs yet), it is slower on a GPU than the replays,
so nothing runs it but its tests: it is the next step for mixed steps.

A packed forward: several groups of sequences in ONE pass over the weights, no padding.

    outs = forward_packed(model, [Group(tokens_d, slots_d),                    # decode [b, 1]
                                  Group(tokens_c, [s], [n], last_only=True)])   # a chunk [1, n]

What a serving step needs when it carries the running requests' decode (or verify) tokens
and prompt chunks together (vLLM's chunked prefill, the simulator's mixed step): every
linear, norm and MLP runs once over all T tokens of all groups ([1, T, H]: the weights are
read once), and only attention, which depends on each sequence's cache, runs per group, on
that group's [b, m] view. A group is b sequences of m new tokens each (n_new[i] <= m real,
the rest padding, as in Qwen3Model.forward); T = sum of b * m. Each group's result is the
greedy token at every position ([b, m]) or, with last_only, after each row's last real
token ([b]). Exact against running each group as its own forward: the same ops on the same
rows (tests/test_packed.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel_rt.model import Qwen3Model


@dataclass
class Group:
    tokens: torch.Tensor  # [b, m] int64
    slots: list[int]  # the KV slot of each row
    n_new: list[int] | None = None  # real tokens per row (default: all m)
    last_only: bool = False  # one result per row: after its last real token


@torch.inference_mode()
def forward_packed(model: Qwen3Model, groups: list[Group]) -> list[torch.Tensor]:
    """Append every group's tokens to its sequences' KV in one forward; the greedy tokens of
    each group ([b, m], or [b] with last_only), int64 on the model's device."""
    be, s, kv = model.backend, model.shape, model.kv
    D, Hq, Hkv = s.head_dim, s.num_attention_heads, s.num_key_value_heads
    slots = [slot for g in groups for slot in g.slots]
    if len(set(slots)) != len(slots):
        raise ValueError(f"a sequence appears in two groups of one packed forward: {slots}")
    parts = []  # (offset, b, m, step)
    offset = 0
    for g in groups:
        b, m = g.tokens.shape
        n_new = [m] * b if g.n_new is None else list(g.n_new)
        parts.append((offset, b, m, kv.step(list(g.slots), m, n_new)))
        offset += b * m
    tokens = torch.cat([g.tokens.reshape(-1) for g in groups]).to(model.device)[None]  # [1, T]

    def attend(qkv: torch.Tensor, layer: int) -> torch.Tensor:  # [1, T, (Hq+2Hkv) D]
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        outs = []
        for start, b, m, step in parts:
            end = start + b * m
            o = be.rope_attention(q[:, start:end].view(b, m, Hq, D),
                                  k[:, start:end].view(b, m, Hkv, D),
                                  v[:, start:end].view(b, m, Hkv, D), layer, step)
            outs.append(o.reshape(1, b * m, Hq * D))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [1, T, Hq D]

    x = model.layers(be.embed(tokens), attend)  # [1, T, H]
    rows = []  # the positions whose greedy token each group returns
    for (start, b, m, step), g in zip(parts, groups):
        base = start + torch.arange(b, device=x.device) * m  # [b]
        rows.append(base + step.n_new - 1 if g.last_only else
                    (base[:, None] + torch.arange(m, device=x.device)).reshape(-1))
    picked = be.greedy_tokens(x[:, torch.cat(rows)])[0]  # [R]
    for g, (_, b, m, step) in zip(groups, parts):
        kv.advance(list(g.slots), [m] * b if g.n_new is None else list(g.n_new))
    out, at = [], 0
    for g, (_, b, m, _) in zip(groups, parts):
        n = b if g.last_only else b * m
        out.append(picked[at:at + n] if g.last_only else picked[at:at + n].view(b, m))
        at += n
    return out


@torch.inference_mode()
def forward_mixed(model: Qwen3Model, rows: Group, chunks: list[Group]) -> list[torch.Tensor]:
    """The rows' forward (greedy at every position, [b, m]), then each chunk's ([b]: after
    its last real token), one after the other: a mixed step as serving runs it."""
    out = [model.forward(rows.tokens, rows.slots, rows.n_new, greedy=True)]
    for g in chunks:
        out.append(model.forward(g.tokens, g.slots, g.n_new, last_only=True, greedy=True))
    return out
