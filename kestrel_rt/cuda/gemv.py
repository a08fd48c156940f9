"""The skinny-matmul kernels of one backend: y = [residual +] x @ W.T for a few rows of x.

    gemv = Gemv("cuda", GemvDevice(sms, max_shared, bulk=True, ring=False), pdl=True)
    y = gemv.linear(x, w, matmul="qkv")                 # kernel for <= 16 rows, else cuBLAS
    y = gemv.fused(x, w, matmul="o", residual=r)        # None where no kernel takes it

`w` is a bf16 tensor [N, K], an Int8Weight or an Int4Weight (kestrel_rt/quant_weights.py;
kestrel_rt/cuda/gemv_weights.py says how each is read). Which kernel runs is decided by
kestrel_rt/cuda/gemv_plan.py: the bulk-copy kernel (kernels/gemv_bulk.cu), the cp.async ring
(kernels/gemv_ring.cu) or the tuned kernels (kernels/gemv.cu, gemv_int8.cu, gemv_int4.cu),
each launched on torch's current stream (so they interleave with torch ops and are captured
in CUDA graphs). More rows (prefill) go to torch's matmul (cuBLAS); a quantized weight is
dequantized to bf16 first by a one-pass kernel, small next to a prefill's matmul.

`fused` folds what comes around the matmul into the same launch: the residual add
(`residual`), the SwiGLU of a [gate; up] weight's two halves (`glu`), and the RMSNorm of x
with a unit weight, the real one folded into W at load (kestrel_rt/fold.py), as a per-row
scale of the result (`rstd`, bf16 weights). One Gemv per backend: it owns the compiled
modules (cupy RawModule per (file, PRO), compiled on first use) and keeps no tensors.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kestrel_rt.cuda.gemv_plan import GemvDevice, Plan, plan
from kestrel_rt.cuda.gemv_variants import (
    ARGMAX,
    BF16_MAX_ROWS,
    GLU,
    KERNELS,
    MAX_ROWS,
    PLAIN,
    RESIDUAL,
    RSTD,
    TUNED_FILE,
    bulk_name,
    bulk_shared_bytes,
    kernel_name,
    load_tuned,
    module_names,
    persistent_names,
    ring_name,
    ring_shared_bytes,
)
from kestrel_rt.cuda.gemv_weights import FORMATS, kernel_reads, output, weight_format
from kestrel_rt.cuda.module import (
    current_stream,
    ensure_dynamic_shared,
    f32,
    full_source,
    i32,
    ptr,
)
from kestrel_rt.cuda.ops import check_host_out
from kestrel_rt.quant import int4_fits
from kestrel_rt.quant_weights import weight_kind

MAX_SHARED_PER_BLOCK_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin (driver_types.h)
# Every gemv kernel lets the next kernel launch (PDL) after its K loop rather than at its top
# (kernels/pdl.cuh): faster for every model measured (docs/performance.md).
OPTIONS = ("-std=c++17", "-DGEMV_LATE_TRIGGER")


def gemv_device(device: torch.device | str, bulk: bool, ring: bool, bulk_rstd: bool = True
                ) -> GemvDevice:
    """The plan table's view of a CUDA device with these kernel choices."""
    import cupy

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return GemvDevice(
        sms=torch.cuda.get_device_properties(index).multi_processor_count,
        max_shared=cupy.cuda.runtime.deviceGetAttribute(MAX_SHARED_PER_BLOCK_OPTIN, index),
        bulk=bulk, ring=ring, bulk_rstd=bulk_rstd)


class Gemv:
    """The skinny-matmul kernels of one backend, on one CUDA device."""

    def __init__(self, device: torch.device | str, target: GemvDevice, pdl: bool = False,
                 sweep: bool = False, tuned: Path | None = None) -> None:
        """target: the kernel choices (gemv_device); pdl: launch with programmatic dependent
        launch (sm_90+); sweep: compile every variant (bench/gemv_bench.py --sweep)."""
        import cupy

        self._cupy = cupy
        device = torch.device(device)
        self.device_index = (device.index if device.index is not None
                             else torch.cuda.current_device())
        self.target = target
        self.sms = target.sms
        self.tuned = load_tuned(tuned or TUNED_FILE)
        self.sweep = sweep
        self._modules: dict[tuple[str, int], object] = {}
        self._streams: dict[int, object] = {}
        # dynamic shared memory each persistent kernel was allowed, by function: the
        # attribute is only ever raised, so a launch asking no more skips the driver call
        self._shared: dict[tuple[str, int, str], int] = {}
        self._pdl = None
        if pdl and torch.cuda.get_device_capability(self.device_index) >= (9, 0):
            from kestrel_rt.cuda.pdl import Launcher

            self._pdl = Launcher()

    # -- modules and launches ------------------------------------------------------------
    def module(self, file: str, pro: int = PLAIN):
        """kernels/FILE.cu's module for prologue pro (compiled on first use)."""
        key = (file, pro)
        if key not in self._modules:
            names = (persistent_names(file, pro) if file in ("gemv_ring", "gemv_bulk")
                     else module_names(file, pro, self.tuned, self.sweep))
            with self._cupy.cuda.Device(self.device_index):
                module = self._cupy.RawModule(code=full_source(file), options=OPTIONS,
                                              name_expressions=names)
                module.compile()
            self._modules[key] = module
        return self._modules[key]

    def compile(self, pros: tuple[int, ...] = (PLAIN,)) -> None:
        """Compile the tuned kernels' modules for these prologues now (before a capture)."""
        for file in KERNELS:
            for pro in pros:
                self.module(file, pro)

    def _stream(self):
        return current_stream(self._cupy, self.device_index, self._streams)

    def _run(self, fn, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        """Launch on torch's current stream (PDL when enabled)."""
        if self._pdl is not None:
            handle = torch.cuda.current_stream(self.device_index).cuda_stream
            self._pdl(fn, grid, block, args, handle, shared_mem)
            return
        with self._cupy.cuda.Device(self.device_index):
            fn(grid, block, args, shared_mem=shared_mem, stream=self._stream())

    def launch(self, file: str, name: str, grid: tuple, block: tuple, args: tuple,
               pro: int = PLAIN) -> None:
        """Kernel `name` of kernels/FILE.cu (module of prologue pro) on torch's current
        stream, without PDL: the expert kernels (kestrel_rt/cuda/gemv_moe.py) hit an illegal
        address under PDL on the H200 (cause not found)."""
        fn = self.module(file, pro).get_function(name)
        with self._cupy.cuda.Device(self.device_index):
            fn(grid, block, args, stream=self._stream())

    # -- one launch of a plan ------------------------------------------------------------
    def plan(self, w, pro: int, rows: int, k: int, matmul: str | None = None) -> Plan:
        """The table's plan for weight w (kestrel_rt/cuda/gemv_plan.py)."""
        return plan(weight_kind(w), pro, rows, w.shape[0], k, matmul, self.target, self.tuned)

    def matmul(self, x: torch.Tensor, w, out: torch.Tensor | None = None, *,
               residual: torch.Tensor | None = None, glu: bool = False, rstd: bool = False,
               eps: float = 0.0, matmul: str | None = None,
               chosen: Plan | None = None, argmax: tuple | None = None) -> torch.Tensor:
        """y [M, N] = residual + act(x) @ W.T through the planned kernel (or `chosen`, for
        benchmarks and tests). x [M, K] bf16 contiguous; residual [M, N] (out may be it); glu: W is [gate; up] (N = 2I) and
        y [M, I] = silu(x @ gate.T) * (x @ up.T), no residual; rstd (bf16, plain x): y[m]
        scaled by rsqrt(mean(x[m]^2) + eps). argmax (bf16 bulk kernel): its (out, host,
        parity, keys, count) instead of y."""
        m, n, k = x.shape[0], w.shape[0], w.shape[1]
        if x.shape[1] != k:
            raise ValueError(f"x {list(x.shape)} does not fit a weight [{n}, {k}]")
        if glu and (n % 16 or residual is not None):
            raise ValueError(f"the SwiGLU epilogue takes a [gate; up] weight of 2I rows with "
                             f"I % 8 == 0 (got {n} rows) and no residual")
        if rstd and weight_kind(w) != "bf16":
            raise ValueError("the row-scale RMSNorm (rstd) takes bf16 weights")
        if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
            raise ValueError(f"residual must be a contiguous [{m}, {n}], got "
                             f"{list(residual.shape)}")
        pro = (PLAIN | (RESIDUAL if residual is not None else 0) | (GLU if glu else 0) | (RSTD if rstd else 0) | (ARGMAX if argmax else 0))
        chosen = chosen or self.plan(w, pro, m, k, matmul)
        y = None if argmax else output(out, m, n // 2 if glu else n, x.device)
        fmt = weight_format(w)
        if chosen.kernel == "tuned":
            ks, tpb = chosen.setting[:2]
            fn = self.module(fmt.file, pro).get_function(
                kernel_name(fmt.file, 1 if m <= 8 else 2, chosen.setting, pro))
            tail = (f32(eps), ptr(residual)) if fmt.file == "gemv" else (ptr(residual),)
            self._run(fn, (math.ceil(n / (16 * tpb)),), (32 * ks * tpb,),
                      (*fmt.args(w), ptr(x), ptr(y), i32(m), i32(n), i32(k), *tail))
        elif chosen.kernel == "bulk":
            warps, slots, row_bytes = chosen.setting
            extra = tuple(ptr(t) for t in (argmax or (None,) * 5))
            self._persistent("gemv_bulk", bulk_name(warps, slots, row_bytes, pro), pro,
                             bulk_shared_bytes(warps, slots, row_bytes, m, k),
                             min(math.ceil(n / 16), self.sms), 32 * (warps + 1),
                             (ptr(w), ptr(x), ptr(y), i32(m), i32(n), i32(k), ptr(residual),
                              f32(eps), *extra))
        else:
            ks, slots, bps = chosen.setting
            self._persistent("gemv_ring", ring_name(ks, slots, pro), pro,
                             ring_shared_bytes(ks, slots, m, k),
                             min(math.ceil(n / 16), self.sms * bps), 32 * ks,
                             (ptr(w), ptr(x), ptr(y), i32(m), i32(n), i32(k), ptr(residual)))
        return y

    def _persistent(self, source: str, name: str, pro: int, smem: int, blocks: int,
                    threads: int, args: tuple) -> None:
        """One wave of `blocks` blocks of kernels/SOURCE.cu:NAME with smem dynamic bytes."""
        fn = self.module(source, pro).get_function(name)
        key = (source, pro, name)
        if self._shared.get(key, -1) < smem:
            ensure_dynamic_shared(fn, smem)
            self._shared[key] = smem
        self._run(fn, (blocks,), (threads,), args, smem)

    # -- what the backend calls ------------------------------------------------------------
    def supports(self, x2: torch.Tensor, w, k: int | None = None) -> bool:
        """True when a gemv kernel takes x2 [M, K] and weight w as they are (k: the weight's
        K, default x2's)."""
        m = x2.shape[0]
        k = x2.shape[1] if k is None else k
        if not (x2.is_cuda and x2.dtype == torch.bfloat16 and 0 < m <= MAX_ROWS
                and x2.is_contiguous() and x2.data_ptr() % 16 == 0):
            return False
        if w.dim() != 2 or (weight_kind(w) == "bf16" and m > BF16_MAX_ROWS):
            return False
        return kernel_reads(w, w.shape[0], k)

    def fused(self, x: torch.Tensor, w, *, residual: torch.Tensor | None = None,
              glu: bool = False, rstd: bool = False, eps: float = 0.0,
              matmul: str | None = None) -> torch.Tensor | None:
        """residual + x @ W.T -> [..., N] bf16 in one launch (glu, rstd: see matmul), or None
        when no kernel takes these inputs (rows, dtypes, alignment, K: see supports), so the
        caller composes the unfused ops. residual [..., N] bf16 is added as torch's
        `residual + y` rounds. Wrong shapes raise ValueError."""
        lead, n, k = x.shape[:-1], w.shape[0], w.shape[-1]
        if (glu and n % 16) or (rstd and weight_kind(w) != "bf16"):
            return None
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        if not self.supports(x2, w, k):
            return None
        res2 = None
        if residual is not None:
            if residual.shape != (*lead, n):
                raise ValueError(f"residual {list(residual.shape)} must be {[*lead, n]}")
            if not (residual.is_cuda and residual.dtype == torch.bfloat16
                    and residual.is_contiguous()):
                return None
            res2 = residual.reshape(-1, n)  # [M, N]
        y = self.matmul(x2, w, residual=res2, glu=glu, rstd=rstd, eps=eps, matmul=matmul)
        return y.reshape(*lead, y.shape[-1])

    def linear(self, x: torch.Tensor, w, matmul: str | None = None) -> torch.Tensor:
        """x [..., in] @ W.T -> [..., out]: kernel for <= 16 rows, else cuBLAS."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)  # [M, K]
        if self.supports(x2, w):
            return self.matmul(x2, w, matmul=matmul).reshape(*lead, w.shape[0])
        if weight_kind(w) in ("int8", "int4"):
            if x.dtype == torch.bfloat16 and self.can_dequantize(w):
                return F.linear(x, self.dequantize(w))
            return F.linear(x, w.dequantize(x.dtype))
        return F.linear(x, w)

    def takes_argmax(self, x: torch.Tensor, w, rstd: bool) -> bool:
        """True when `argmax` launches for x [M, K] and weight w (see there)."""
        if not (weight_kind(w) == "bf16" and x.dim() == 2 and w.dim() == 2
                and w.shape[1] == x.shape[1] and self.supports(x, w)):
            return False
        pro = (RSTD if rstd else PLAIN) | ARGMAX
        return self.plan(w, pro, x.shape[0], x.shape[1], "lm_head").kernel == "bulk"

    def argmax(self, x: torch.Tensor, w, *, rstd: bool, eps: float,
               state: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
               host: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """out [M] int64 <- the greedy choice of each row of x [M, K] over x @ W.T (W [N, K]
        bf16; rstd: each row of x scaled by its RMSNorm as fused(rstd=True, eps) scales it),
        over the results rounded to bf16 as `fused` stores them, with torch.argmax's ties and
        NaNs, in the bulk kernel itself (its ARGMAX epilogue: no y, no second launch): True.
        False, with nothing launched, where the bulk kernel does not take the launch.
        state: (keys int64 [M], count int32 [1]), zeros, kept by the caller (the kernel leaves
        them at zero, so a captured graph replays); host: (pinned int64 [2, M], parity int64
        [1] on the device): the ids are also written to host[parity] (ops.argmax)."""
        if not self.takes_argmax(x, w, rstd):
            return False
        m = x.shape[0]
        keys, count = state
        if (keys.shape != (m,) or keys.dtype != torch.long or count.numel() < 1
                or count.dtype != torch.int32 or out.shape != (m,) or out.dtype != torch.long
                or not out.is_contiguous()):
            raise ValueError(f"argmax: keys {tuple(keys.shape)} {keys.dtype}, count "
                             f"{tuple(count.shape)} {count.dtype}, out {tuple(out.shape)} "
                             f"{out.dtype}: expected int64 [{m}], int32 [1], int64 [{m}]")
        check_host_out(host, m, x.device)
        buf, parity = (None, None) if host is None else host
        self.matmul(x, w, rstd=rstd, eps=eps, matmul="lm_head",
                    argmax=(out, buf, parity, keys, count))
        return True

    # -- quantized weights for prefill -------------------------------------------------------
    def can_dequantize(self, w) -> bool:
        kind = weight_kind(w)
        if kind == "int8":
            return w.dim() == 2 and w.q.is_cuda and w.q.is_contiguous() and w.shape[1] % 8 == 0
        return (kind == "int4" and w.dim() == 2 and w.qweight_t.is_cuda
                and w.qweight_t.is_contiguous() and w.scales.is_contiguous()
                and int4_fits(*w.shape))

    def dequantize(self, w) -> torch.Tensor:
        """The bf16 [N, K] weight of a quantized one, in one pass on the GPU (for prefill,
        then cuBLAS); bitwise equal to w.dequantize(torch.bfloat16)."""
        n, k = w.shape
        out = torch.empty(n, k, device=w.device, dtype=torch.bfloat16)
        items = n * k // 8
        grid = (max(1, min(math.ceil(items / 256), self.sms * 16)),)
        kind = weight_kind(w)
        name = f"dequant_{kind}"
        args = (*FORMATS[kind].args(w), ptr(out), i32(n), i32(k))
        fn = self.module(FORMATS[kind].file).get_function(name)
        with self._cupy.cuda.Device(self.device_index):
            fn(grid, (256,), args, stream=self._stream())
        return out

