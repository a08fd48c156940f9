"""A dense layer's attention output and MLP as one persistent launch (kernels/bulk_mlp.cu).

    mlp = BulkMlp(gemv)                      # one per Gemv (per backend instance)
    h = mlp(o, h_in, wo, wgu, wd, nw, eps)   # or None where the kernel does not take it

h = h_in + o @ wo.T; h += down(silu(gate) * up) of RMSNorm(h) (weight nw): the three
gemv_bulk_bf16 launches of `linear_add`, `norm_linear_swiglu` (norm in the staging) and
`linear_add` in one, their weights streamed through one ring without a stop between them
(the consumers meet at two grid barriers). bf16 weights on sm_90 with the Gemv's bulk setting
(WARPS, S, C), at most `bulk_max_rows` rows of x, x within the bulk kernels' staging budget.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kestrel_rt.cuda.gemv_variants import BULK_PAD, RING_X_BYTES
from kestrel_rt.cuda.module import full_source, set_max_dynamic_shared


def mlp_name(warps: int, slots: int, row_bytes: int) -> str:
    return f"bulk_mlp_bf16<{warps}, {slots}, {row_bytes}>"


def mlp_shared_bytes(warps: int, slots: int, row_bytes: int, m: int, widest: int) -> int:
    """Dynamic shared memory of a launch: the ring, then x [m, widest] bf16."""
    return slots * 16 * (row_bytes + BULK_PAD["gemv"]) + m * widest * 2


def mlp_static_bytes(warps: int, slots: int) -> int:
    """Static shared memory: mbarriers, two tiles' per-warp sums, the RMSNorm partials."""
    return 16 * slots + 4 * 2 * warps * 4 * 32 + 4 * (warps + 1) * 8


class BulkMlp:
    """The fused launch of one Gemv (its device, bulk setting, PDL launcher, carveout); owns
    the grid barrier's arrival counters, one per grid size (they only grow: a launch passes
    each barrier at the next multiple of its grid, so graphs replay them as they are)."""

    def __init__(self, gemv, defines: tuple[str, ...] = ()) -> None:
        """defines: extra compile options (bench/mlp_bench.py's probes, e.g. -DMLP_NO_BARRIER)."""
        self.gemv = gemv
        self.defines = defines
        self._modules: dict[tuple[int, int, int], object] = {}
        self._shared_set: dict[str, int] = {}
        self._barriers: dict[int, torch.Tensor] = {}

    def takes(self, m: int, hidden: int, k_o: int, inter: int) -> bool:
        """True when a launch of m rows, hidden size H, o width KO and MLP width I goes to the
        kernel: a bulk setting (sm_90), m <= bulk_max_rows, whole 16-byte vectors (and
        16-row gate/up tiles), x within the staging budget, the shared memory within a block's."""
        g = self.gemv
        if g.bulk is None or not 0 < m <= g.bulk_max_rows:
            return False
        if hidden % 16 or inter % 8 or k_o % 8:
            return False
        widest = max(hidden, k_o, inter)
        if m * widest * 2 > RING_X_BYTES:
            return False
        warps, slots, row_bytes = g.bulk
        return (mlp_shared_bytes(warps, slots, row_bytes, m, widest)
                + mlp_static_bytes(warps, slots)) <= g.max_shared

    def __call__(self, o: torch.Tensor, h_in: torch.Tensor, wo: torch.Tensor,
                 wgu: torch.Tensor, wd: torch.Tensor, nw: torch.Tensor, eps: float
                 ) -> torch.Tensor | None:
        """o [M, KO], h_in [M, H] bf16; wo [H, KO], wgu [2I, H] (gate rows, then up), wd [H, I],
        nw [H] bf16 -> the new h [M, H], or None when the kernel does not take the shapes."""
        m, k_o = o.shape
        hidden, inter = wo.shape[0], wd.shape[1]
        tensors = (o, h_in, wo, wgu, wd, nw)
        if (any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in tensors)
                or h_in.shape != (m, hidden) or wo.shape != (hidden, k_o)
                or wgu.shape != (2 * inter, hidden) or wd.shape != (hidden, inter)
                or nw.shape != (hidden,) or not self.takes(m, hidden, k_o, inter)):
            return None
        g = self.gemv
        warps, slots, row_bytes = g.bulk
        fn = self._function(g.bulk)
        name = mlp_name(*g.bulk)
        smem = mlp_shared_bytes(warps, slots, row_bytes, m, max(hidden, k_o, inter))
        if self._shared_set.get(name, 0) < smem:
            set_max_dynamic_shared(fn, smem)
            self._shared_set[name] = smem
        blocks = min(g.sms, math.ceil(2 * inter / 16))
        if blocks not in self._barriers:
            self._barriers[blocks] = torch.zeros(1, dtype=torch.int64, device=o.device)
        h = torch.empty(m, hidden, device=o.device, dtype=torch.bfloat16)
        act = torch.empty(m, inter, device=o.device, dtype=torch.bfloat16)
        p = [np.uint64(t.data_ptr()) for t in (wo, wgu, wd, o, h_in, h, act, nw)]
        args = (*p, np.float32(eps), np.int32(m), np.int32(hidden), np.int32(k_o),
                np.int32(inter), np.uint64(self._barriers[blocks].data_ptr()))
        g._run(fn, (blocks,), (32 * (warps + 1),), args, smem)
        return h

    def _function(self, setting: tuple[int, int, int]):
        module = self._modules.get(setting)
        if module is None:
            cupy = self.gemv._cupy
            with cupy.cuda.Device(self.gemv.device_index):
                module = cupy.RawModule(code=full_source("bulk_mlp"), options=self.gemv.options + self.defines,
                                        name_expressions=[mlp_name(*setting)])
                module.compile()
            self._modules[setting] = module
        return module.get_function(mlp_name(*setting))
