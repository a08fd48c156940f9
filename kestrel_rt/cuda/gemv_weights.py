"""How the gemv kernels read each kind of weight: one table, keyed by `weight_kind`.

For each kind that has kernels (bf16 tensors, Int8Weight, Int4Weight): the kernels/ file,
whether the kernels read a given weight as it is stored (device, layout, K and N as their
loads need), and the weight's leading kernel arguments (before x).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kestrel_rt.cuda.module import ptr
from kestrel_rt.quant import int4_fits
from kestrel_rt.quant_weights import weight_kind


@dataclass(frozen=True)
class WeightFormat:
    file: str  # kernels/FILE.cu
    reads: Callable[[object, int, int], bool]  # (w, n, k): the kernels take w as stored
    args: Callable[[object], tuple]  # the weight's leading kernel arguments


def _reads_bf16(w, n: int, k: int) -> bool:
    return (w.is_cuda and w.is_contiguous() and k % 8 == 0 and w.data_ptr() % 16 == 0)


def _reads_int8(w, n: int, k: int) -> bool:
    return k % 16 == 0 and w.q.is_cuda and w.q.is_contiguous()


def _reads_int4(w, n: int, k: int) -> bool:
    return (int4_fits(n, k) and w.qweight_t.is_cuda and w.qweight_t.is_contiguous()
            and w.scales.is_contiguous())


FORMATS = {
    "bf16": WeightFormat("gemv", _reads_bf16, lambda w: (ptr(w),)),
    "int8": WeightFormat("gemv_int8", _reads_int8, lambda w: (ptr(w.q), ptr(w.scales))),
    "int4": WeightFormat("gemv_int4", _reads_int4,
                         lambda w: (ptr(w.qweight_t), ptr(w.qzeros), ptr(w.scales))),
}


def weight_format(w) -> WeightFormat | None:
    """The format entry of weight w, or None for a kind no gemv kernel reads (fp16, fp32)."""
    return FORMATS.get(weight_kind(w))


def kernel_reads(w, n: int, k: int) -> bool:
    """True when the gemv kernels read weight w ([N, K], or experts [E, N, K]) as stored."""
    fmt = weight_format(w)
    return fmt is not None and fmt.reads(w, n, k)


def output(out: torch.Tensor | None, m: int, n: int, device) -> torch.Tensor:
    """`out` checked to be a contiguous bf16 [m, n] on the device, or a new one."""
    if out is None:
        return torch.empty(m, n, device=device, dtype=torch.bfloat16)
    if out.shape != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [{m}, {n}], got {out.dtype} "
                         f"{list(out.shape)}")
    return out
