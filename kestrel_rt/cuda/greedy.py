"""The greedy choice of a decode step on the GPU, without writing fp32 logits.

    tokens = head.choose(x, out, host)      # x [B, M, H] -> [B, M] int64

At one or two rows the lm_head's bulk gemv takes the argmax itself (its ARGMAX epilogue,
Gemv.argmax: no logits written, no second launch), with the final RMSNorm as its row scale
when the norm is folded (kestrel_rt/fold.py) or the rmsnorm kernel before it; elsewhere the
lm_head's bf16 output goes through kernels/argmax.cu. Either way the choice is over the bf16
logits whose fp32 widening Backend.logits returns, so it is the same choice. host: (pinned
int64 [2, rows], parity int64 [1] on the device): the kernel also writes the ids to
host[parity], so an overlapped decode loop reads them with no copy on the stream. The
buffers these kernels keep between launches are made once per shape and kept, so a captured
CUDA graph replays with the same addresses.
"""

from __future__ import annotations

import torch

from kestrel_rt.cuda import ops
from kestrel_rt.cuda.ops import Unsupported


class GreedyHead:
    """The argmax kernels' buffers of one backend, and the choice between them."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._scratch: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # argmax.cu's
        self._state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # Gemv.argmax's

    def choose(self, x: torch.Tensor, out: torch.Tensor | None = None,
               host: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """argmax over the vocabulary of norm + lm_head of x [B, M, H] -> [B, M] int64."""
        chosen = self._in_lm_head(x, out, host)
        if chosen is not None:
            return chosen
        be = self.backend
        h = be.norm_linear(x, "norm", "lm_head")  # [B, M, V]
        V = h.shape[-1]
        rows = h.numel() // V if V else 0
        try:
            scratch = self._scratch.get((rows, V))
            if scratch is None:
                scratch = ops.argmax_scratch(rows, V, h.device)
                self._scratch[(rows, V)] = scratch
            return ops.argmax(be.kernels, h, scratch, out, host)  # [B, M]
        except Unsupported:
            if host is not None:
                raise
            tokens = h.float().argmax(-1)
            return tokens if out is None else out.copy_(tokens)

    def _in_lm_head(self, x: torch.Tensor, out: torch.Tensor | None,
                    host: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """The choice by the lm_head's bulk gemv, where it takes the shape; None (nothing
        launched) elsewhere."""
        be = self.backend
        if out is not None and not out.is_contiguous():
            return None
        w, unit = be.weight("lm_head"), be.is_unit_norm("norm")
        x2 = x.reshape(-1, x.shape[-1])  # [rows, H]
        if not be.gemv.takes_argmax(x2, w, unit):
            return None
        if not unit:
            x2 = be.rms_norm(x2, "norm")
        rows = x2.shape[0]
        state = self._state.get(rows)
        if state is None:
            state = (torch.zeros(rows, dtype=torch.long, device=x.device),
                     torch.zeros(1, dtype=torch.int32, device=x.device))
            self._state[rows] = state
        dest = (torch.empty(rows, dtype=torch.long, device=x.device) if out is None
                else out.view(rows))
        be.gemv.argmax(x2, w, rstd=unit, eps=be.shape.rms_norm_eps, state=state, out=dest,
                       host=host)
        return dest.view(x.shape[:-1])
