"""What the gemv kernel tests share: a Gemv with chosen kernel paths, weights, references.

Fresh random inputs; outputs go into a NaN-poisoned buffer (every element must be written);
relative error ||y - ref|| / ||ref|| <= TOL for bf16 operands; NaN never passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel_rt.cuda.gemv import Gemv, gemv_device
from kestrel_rt.cuda.gemv_variants import RING_X_BYTES, bulk_shared_bytes, bulk_static_bytes
from kestrel_rt.options import default_options
from kestrel_rt.quant_weights import Int4Weight, Int8Weight

TOL = 1e-2
CUDA = torch.device("cuda")


def hopper() -> bool:
    """True on compute capability 9.0+, where the bulk-copy gemv runs."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def make_gemv(bulk: bool | None = None, ring: bool | None = None, pdl: bool = False,
              sweep: bool = False) -> Gemv:
    """A Gemv on the current CUDA device whose plan takes the bulk kernel (bulk) and the ring
    kernel (ring); None: what default_options chooses for this device (the bulk kernel on
    sm_90+, the ring below it: no load-time ring probe here, unlike CupyBackend.load)."""
    options = default_options(CUDA, backend="cupy")
    target = gemv_device(CUDA, bulk=options.bulk_gemv if bulk is None else bulk,
                         ring=options.ring_gemv if ring is None else ring)
    return Gemv(CUDA, target, pdl=pdl, sweep=sweep)


def bulk_fits(gemv: Gemv, setting: tuple[int, int, int], rows: int, k: int) -> bool:
    """True when the bulk kernel at `setting` (WARPS, S, C) takes `rows` rows of x [rows, k]
    on this device (what gemv_plan asks of it, rows and shared memory): at most 8 rows, x
    within RING_X_BYTES, slots + x + static shared bytes within the block limit."""
    smem = bulk_shared_bytes(*setting, rows, k) + bulk_static_bytes(*setting[:2])
    return rows <= 8 and rows * k * 2 <= RING_X_BYTES and smem <= gemv.target.max_shared


def weight(kind: str, n: int, k: int, gen: torch.Generator):
    """(weight [N, K] of kind bf16 / int8 / int4, its dense float64 [N, K])."""
    w32 = torch.randn(n, k, device="cuda", generator=gen)
    if kind == "bf16":
        w = (w32 * 0.02).bfloat16()
        return w, w.double()
    w = (Int8Weight if kind == "int8" else Int4Weight).from_float(w32)
    return w, w.dequantize(torch.float64)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (an element not written, or a NaN)"
    return ((y.double() - ref).norm() / ref.norm()).item()


def poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)


def silu_glu_ref(prod: torch.Tensor) -> torch.Tensor:
    """TorchBackend.swiglu of the bf16 linear [M, 2I] -> [M, I] (float64)."""
    gate, up = prod.bfloat16().chunk(2, dim=-1)
    return (F.silu(gate.float()).bfloat16() * up).double()


def unit_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """TorchBackend.rms_norm of bf16 x [M, K] with a unit weight: bf16(x * rstd)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
