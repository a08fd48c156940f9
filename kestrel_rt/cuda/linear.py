"""The dense linear path on the GPU: skinny-matmul kernels for decode / verify, cuBLAS beyond.

`Gemv(device).linear(x, w)` computes x [..., in] @ W.T for a weight `w` that is a bf16 tensor
[out, in], an `Int8Weight` or an `Int4Weight` (kestrel_rt/quant_weights.py):

* M = prod(x.shape[:-1]) <= 16 rows: kernels/gemv.cu, gemv_int8.cu, gemv_int4.cu, launched
  on torch's current stream (so they interleave with torch ops and are captured in CUDA
  graphs), output allocated by torch; bf16 weights at M <= 8 (x within RING_X_BYTES) go to
  a persistent kernel: the bulk-copy one on sm_90 (kernels/gemv_bulk.cu, `Gemv.bulk`), else
  the cp.async ring (kernels/gemv_ring.cu, `Gemv.ring`); int4 weights with `bulk_int4` /
  `ring_int4` (both off by default);
* more rows (prefill): torch's matmul (cuBLAS); a quantized weight is dequantized to bf16
  first by a one-pass kernel (dequant_int8 / dequant_int4), small next to a prefill's matmul.

`Gemv(device).fused(x, w, norm=..., swiglu=..., residual=...)` is the same kernel with the
op before it and the residual add after it folded in (kernels/gemv_mma.cuh, PRO):
residual + act(x) @ W.T with act an RMSNorm or a SwiGLU of x, or None when no kernel takes
the inputs (the caller then composes the unfused ops). `rstd=True` (bf16 weights) is the
RMSNorm of x with a unit weight, the real one folded into W at load (kestrel_rt/fold.py),
applied as a per-row scale of the result in the epilogue. `ssq_out` (with a residual) also
writes the sums of squares of the result's rows per 16-column tile; `ssq_in` is such a buffer
of x, and the RMSNorm of x with a unit weight becomes a row scale computed from it (no
squares of x in the kernel: kernels/gemv_mma.cuh, SSQ and RSTD_IN).

One `Gemv` per backend instance: it owns the compiled modules (cupy RawModule, one per
(file, prologue), compiled on first use) and nothing else; it keeps no tensors between calls.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kestrel_rt.cuda.gemv_variants import (
    ARGMAX,
    BF16_MAX_ROWS,
    BULK_DEFAULT,
    BULK_MAX_ROWS,
    BULK_RSTD_PROS,
    BULK_VARIANTS,
    GLU,
    KERNELS,
    MAX_ROWS,
    PLAIN,
    RESIDUAL,
    RING_DEFAULT,
    RING_PROS,
    RING_VARIANTS,
    RING_X_BYTES,
    RMSNORM,
    RSTD,
    RSTD_IN,
    SSQ,
    SWIGLU,
    TUNED_FILE,
    bulk_name,
    bulk_shared_bytes,
    bulk_static_bytes,
    default_variant,
    kernel_name,
    load_tuned,
    module_names,
    persistent_names,
    ring_name,
    ring_shared_bytes,
    ring_static_bytes,
    ring_tiles,
    ring_warps,
)
from kestrel_rt.cuda.module import Carveout, current_stream, full_source, set_max_dynamic_shared
from kestrel_rt.cuda.ops import check_host_out
from kestrel_rt.cuda.timing import time_graph
from kestrel_rt.quant import int4_fits
from kestrel_rt.quant_weights import Int4Weight, Int8Weight, QuantizedWeight

MAX_SHARED_PER_BLOCK_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin (driver_types.h)


def bulk_capable(device: torch.device | str) -> bool:
    """True where the bulk-copy gemvs run (cp.async.bulk, mbarrier transaction counts): a CUDA
    device of compute capability 9.0 or newer."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _source(file: str) -> str:
    """kernels/FILE.cu with its headers (gemv_mma.cuh, pdl.cuh) pasted in: module.full_source
    (keeps cupy's cache key honest)."""
    return full_source(file)


class Gemv:
    """The skinny-matmul kernels of one backend, on one CUDA device."""

    def __init__(self, device: torch.device | str = "cuda", sweep: bool = False,
                 tuned: Path | None = None, pdl: bool = False, late_trigger: bool = True
                 ) -> None:
        """sweep: compile every variant (for bench/gemv_bench.py --sweep), not just the
        tuned and default ones. pdl: launch the gemv kernels with programmatic dependent
        launch (kestrel_rt/cuda/pdl.py; they wait for the previous kernel before their first
        load); needs compute capability >= 9.0, else ignored. late_trigger: let the next
        kernel launch only after the K loop instead of at the top (kernels/pdl.cuh; on the
        H200, bench/ablation.py: qwen3-8b bf16 4.58 vs 4.96 ms per step, int4 2.56 vs 2.71,
        qwen3-30b-a3b 3.31 vs 3.43, qwen3-0.6b 0.855 vs 0.888)."""
        import cupy

        self._cupy = cupy
        device = torch.device(device)
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.sms = torch.cuda.get_device_properties(self.device_index).multi_processor_count
        self._modules: dict[tuple[str, int], object] = {}
        self._streams: dict[int, object] = {}
        self.tuned = load_tuned(tuned or TUNED_FILE)
        self.sweep = sweep
        self.options = ("-std=c++17",) + (("-DGEMV_LATE_TRIGGER",) if late_trigger else ())
        self._pdl = None
        self.pdl_enabled = True  # switch PDL off for a comparison (bench/ablation.py)
        # The persistent ring kernels (kernels/gemv_ring.cu) at M <= 8 with plain x, a
        # residual or the SwiGLU epilogue, per weight kind: (KSPLIT warps per block, S ring
        # slots per thread, blocks per SM), or None (the tuned kernels). See ring, ring_int4.
        self._rings: dict[str, tuple[int, int, int] | None] = {"gemv": RING_DEFAULT,
                                                               "gemv_int4": None}
        # the bulk-copy kernels need sm_90 (cp.async.bulk, mbarrier transaction counts)
        self.bulk_capable = bulk_capable(torch.device("cuda", self.device_index))
        self._bulks: dict[str, tuple[int, int, int] | None] = {
            "gemv": BULK_DEFAULT if self.bulk_capable else None, "gemv_int4": None}
        # the most rows of x a launch may have to go to a bulk kernel (they take up to 8;
        # above BULK_MAX_ROWS the tuned kernels measured faster)
        self.bulk_max_rows = BULK_MAX_ROWS
        # the row-scale RMSNorm launches (rstd) of bf16 weights go to the bulk kernel too
        self.bulk_rstd = True
        self._shared_set: dict[str, int] = {}  # kernel -> dynamic shared bytes allowed
        # the most shared memory one block may have on this device (a ring launch above it
        # goes to the tuned kernels instead: GPUs with less than an H100's 227 KB)
        self.max_shared = cupy.cuda.runtime.deviceGetAttribute(
            MAX_SHARED_PER_BLOCK_OPTIN, self.device_index)
        self.carveout = Carveout()  # the L1 / shared split its kernels ask for (module.py)
        self.ring_probe_us: tuple[float, float] | None = None  # settle_ring's measurement
        if pdl and torch.cuda.get_device_capability(self.device_index) >= (9, 0):
            from kestrel_rt.cuda.pdl import Launcher

            self._pdl = Launcher()

    @property
    def ring(self) -> tuple[int, int, int] | None:
        """bf16 weights: (KSPLIT, S, BPS) routes decode shapes to gemv_ring_bf16 with KSPLIT
        warps per block, S shared-memory slots per thread and at most BPS blocks per SM
        (RING_DEFAULT); None: the tuned kernels."""
        return self._rings["gemv"]

    @ring.setter
    def ring(self, value: tuple[int, int, int] | None) -> None:
        self._rings["gemv"] = _ring_setting(value, "Gemv.ring", "gemv")

    @property
    def ring_int4(self) -> tuple[int, int, int] | None:
        """int4 weights: as `ring`, for gemv_ring_int4 (16 warps per block on 16 / KSPLIT
        tiles; None by default: slower than the tuned int4 kernel on the H200)."""
        return self._rings["gemv_int4"]

    @ring_int4.setter
    def ring_int4(self, value: tuple[int, int, int] | None) -> None:
        self._rings["gemv_int4"] = _ring_setting(value, "Gemv.ring_int4", "gemv_int4")

    @property
    def bulk(self) -> tuple[int, int, int] | None:
        """bf16 weights: (WARPS, S, C) routes decode shapes to gemv_bulk_bf16 (one block per
        SM: WARPS consumer warps and a producer warp streaming 16-row tiles through S
        shared-memory slots of C bytes per row, filled by bulk copies) instead of `ring`
        (what it declines, such as more than `bulk_max_rows` rows, goes to the tuned
        kernels); BULK_DEFAULT on sm_90 and newer; None: `ring` or the tuned kernels."""
        return self._bulks["gemv"]

    @bulk.setter
    def bulk(self, value: tuple[int, int, int] | None) -> None:
        self._bulks["gemv"] = self._bulk_setting(value, "Gemv.bulk", "gemv")

    @property
    def bulk_int4(self) -> tuple[int, int, int] | None:
        """int4 weights: as `bulk`, for gemv_bulk_int4 (the same prologues and epilogues),
        instead of `ring_int4`; None by default (on the H200 it streams at 35-38% of copy
        where the tuned int4 kernel makes 55%)."""
        return self._bulks["gemv_int4"]

    @bulk_int4.setter
    def bulk_int4(self, value: tuple[int, int, int] | None) -> None:
        self._bulks["gemv_int4"] = self._bulk_setting(value, "Gemv.bulk_int4", "gemv_int4")

    def _bulk_setting(self, value, what: str, file: str) -> tuple[int, int, int] | None:
        """A bulk setting checked: None or (WARPS, S, C) of a compiled variant, on sm_90+."""
        value = _setting(value, what, lambda v: v in BULK_VARIANTS[file],
                         f"(WARPS, S, C) of {list(BULK_VARIANTS[file])}")
        if value is not None and not getattr(self, "bulk_capable", True):
            raise ValueError(f"{what} needs a GPU of compute capability 9.0 or newer")
        return value

    def _run(self, fn, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        """Launch a gemv kernel on torch's current stream (PDL when enabled)."""
        self.carveout.apply(fn)
        if self._pdl is not None and self.pdl_enabled:
            handle = torch.cuda.current_stream(self.device_index).cuda_stream
            self._pdl(fn, grid, block, args, handle, shared_mem)
            return
        with self._cupy.cuda.Device(self.device_index):
            fn(grid, block, args, shared_mem=shared_mem, stream=self._stream())

    def compile(self, pros: tuple[int, ...] = (PLAIN,)) -> None:
        """Compile the three files' modules for these prologues now (before timing or a
        graph capture)."""
        for file in KERNELS:
            for pro in pros:
                self._module(file, pro)

    def _module(self, file: str, pro: int = PLAIN):
        module = self._modules.get((file, pro))
        if module is None:
            with self._cupy.cuda.Device(self.device_index):
                module = self._cupy.RawModule(code=_source(file), options=self.options,
                                              name_expressions=module_names(
                                                  file, pro, self.tuned, self.sweep))
                module.compile()
            self._modules[(file, pro)] = module
        return module

    def _persistent_module(self, source: str, pro: int):
        """kernels/SOURCE.cu (gemv_ring or gemv_bulk) for prologue `pro`: every variant of
        both weight kinds that takes it (persistent_names; compiled on first use)."""
        module = self._modules.get((source, pro))
        if module is None:
            with self._cupy.cuda.Device(self.device_index):
                module = self._cupy.RawModule(code=_source(source), options=self.options,
                                              name_expressions=persistent_names(source, pro))
                module.compile()
            self._modules[(source, pro)] = module
        return module

    def probe_ring(self, n: int = 4096, k: int = 4096, copies: int = 8, reps: int = 5
                   ) -> tuple[float, float]:
        """Device microseconds of one [1, k] x [n, k] bf16 product through the ring kernel
        (`ring`, whatever `bulk` says) and through the tuned kernel: `copies` products on
        distinct weights (more bytes than the L2 holds; their contents do not matter; 256 MB
        while it runs) captured in a CUDA graph (an eager launch costs the host more than the
        kernel takes), median of `reps` replays."""
        dev = torch.device("cuda", self.device_index)
        ws = [torch.empty(n, k, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
        x = torch.zeros(1, k, dtype=torch.bfloat16, device=dev)
        out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)

        def products() -> None:
            for w in ws:
                self.bf16(x, w, out=out)

        saved, bulk, times = self.ring, self.bulk, []
        self.bulk = None  # the ring, not the bulk kernel
        try:
            with torch.cuda.device(dev):
                for setting in (saved, None):
                    self.ring = setting
                    times.append(time_graph(products, reps) * 1e6 / copies)
        finally:
            self.ring, self.bulk = saved, bulk
        return times[0], times[1]

    def settle_ring(self, margin: float = 1.10) -> None:
        """Keep the bf16 ring kernels only where they stream about as fast as the tuned ones
        on this device: `ring` -> None when probe_ring's ring time exceeds the tuned time by
        more than `margin`. Why: the ring's gain is in the decode step (the next kernel's
        weights in flight while this one finishes), but how fast it streams depends on the
        machine: on one H200 it matched the tuned kernels alone (87% against 88% of copy) and
        made the qwen3-8b step 7% faster; on another (same code and driver family) it streamed
        at 63% against 89% and made the step 28% slower (bench/results/NOTES_decode.md, session
        8). Nothing is probed while a CUDA graph is being captured, when the ring is off, or
        when the probe's 256 MB do not fit (the ring stays as it is). The times stay in
        `ring_probe_us` (ring, tuned). Nor while `bulk` is set: bf16 decode gemvs then take
        the bulk kernel, never the ring."""
        if (self.ring is None or self.bulk is not None
                or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
            return
        try:
            self.ring_probe_us = self.probe_ring()
        except torch.OutOfMemoryError:
            return
        ring_us, tuned_us = self.ring_probe_us
        if ring_us > margin * tuned_us:
            self.ring = None

    def takes_ring(self, file: str, pro: int, m: int, k: int) -> bool:
        """True when a launch of kernels/FILE.cu with these goes to the ring kernel: a ring
        and no bulk setting for the weight kind, a prologue it takes, at most 8 rows of x
        within RING_X_BYTES, and the block's shared memory within the device's limit."""
        ring = self._rings.get(file)
        if (ring is None or self._bulks.get(file) is not None
                or not _persistent_takes(pro, m, k, stages_x=True)):
            return False  # (with a bulk setting, what the bulk kernel declines goes tuned)
        ks, slots, _ = ring
        return (ring_shared_bytes(file, ks, slots, m, k) + ring_static_bytes(file, ks)
                <= self.max_shared)

    def takes_bulk(self, file: str, pro: int, m: int, k: int,
                   setting: tuple[int, int, int] | None = None) -> bool:
        """True when a launch goes to a bulk kernel: a bulk setting for the weight kind, a
        prologue it takes (bf16 also the row-scale RMSNorm, BULK_RSTD_PROS, while bulk_rstd
        is on), at most bulk_max_rows (<= 8) rows of x (bf16: within RING_X_BYTES, staged as
        the ring stages it), and the block's shared memory within the device's limit.
        setting: the launch's own (WARPS, S, C) instead of the kind's (see _launch_setting)."""
        setting = self._launch_setting(file, setting)
        pros = RING_PROS + (BULK_RSTD_PROS if file == "gemv" and self.bulk_rstd else ())
        if (setting is None or m > self.bulk_max_rows
                or not _persistent_takes(pro, m, k, stages_x=file == "gemv", pros=pros)):
            return False
        warps, slots, _ = setting
        return (bulk_shared_bytes(file, *setting, m, k) + bulk_static_bytes(file, warps, slots)
                <= self.max_shared)

    def _launch_setting(self, file: str, setting: tuple[int, int, int] | None
                        ) -> tuple[int, int, int] | None:
        """The bulk setting of one launch: `setting` (a compiled (WARPS, S, C) of the kind)
        where the kind has a bulk setting at all, else the kind's own (None: no bulk)."""
        own = self._bulks.get(file)
        if setting is None or own is None:
            return own
        return self._bulk_setting(setting, "a launch's bulk setting", file)

    def _launch_bulk(self, file: str, x, w, y, m: int, n: int, k: int, residual, pro: int,
                     norm, eps: float, argmax: tuple | None = None,
                     setting: tuple[int, int, int] | None = None) -> None:
        """y [M, N] = residual + act(x) @ W.T (or the GLU epilogue) through the bulk kernel
        of the weight kind: one block per SM (fewer when there are fewer tiles). argmax (pro
        with ARGMAX, bf16): the kernel's (out, host, parity, keys, count) instead of y.
        setting: this launch's (WARPS, S, C) instead of the kind's (_launch_setting)."""
        warps, slots, row_bytes = self._launch_setting(file, setting)
        # the bf16 kernel's ARGMAX arguments, null for the other epilogues
        extra = tuple(_p(t) for t in (argmax or (None,) * 5)) if file == "gemv" else ()
        self._launch_persistent("gemv_bulk", bulk_name(file, warps, slots, row_bytes, pro), pro,
                                bulk_shared_bytes(file, warps, slots, row_bytes, m, k),
                                min(math.ceil(n / 16), self.sms), 32 * (warps + 1),
                                (x, w, y, m, n, k, residual, norm, eps), extra)

    def _launch_ring(self, file: str, x, w, y, m: int, n: int, k: int, residual, pro: int,
                     norm, eps: float) -> None:
        """y [M, N] = residual + act(x) @ W.T (or the GLU epilogue; act: x or its RMSNorm
        with weight norm) through gemv_ring.cu: one wave of at most BPS blocks per SM, each
        looping over tiles."""
        ks, slots, bps = self._rings[file]
        sets = math.ceil(math.ceil(n / 16) / ring_tiles(file, ks))  # of tiles a block does at once
        self._launch_persistent("gemv_ring", ring_name(file, ks, slots, pro), pro,
                                ring_shared_bytes(file, ks, slots, m, k),
                                min(sets, self.sms * bps), 32 * ring_warps(file, ks),
                                (x, w, y, m, n, k, residual, norm, eps))

    def _launch_persistent(self, source: str, name: str, pro: int, smem: int, blocks: int,
                           threads: int, call: tuple, extra: tuple = ()) -> None:
        """Launch kernel `name` (prologue pro) of kernels/SOURCE.cu, one wave of `blocks`
        blocks, with smem dynamic shared bytes, on call = (x, w, y, m, n, k, residual, norm,
        eps) and then the kernel's `extra` arguments."""
        x, w, y, m, n, k, residual, norm, eps = call
        fn = self._persistent_module(source, pro).get_function(name)
        if self._shared_set.get(name, 0) < smem:
            set_max_dynamic_shared(fn, smem)
            self._shared_set[name] = smem
        args = (*_weight_args(w), _p(x), _p(y), _i(m), _i(n), _i(k), _p(residual), _p(norm),
                np.float32(eps), *extra)
        self._run(fn, (blocks,), (threads,), args, smem)

    def _stream(self):
        return current_stream(self._cupy, self.device_index, self._streams)

    def variant(self, file: str, n: int, k: int, mt: int) -> tuple[int, int, int, bool]:
        """The launch variant for an [n, k] weight: the tuned one, else the default rule."""
        return self.tuned.get((file, n, k, mt)) or default_variant(file, n, k, self.sms)

    def _launch(self, file: str, x: torch.Tensor, w, out, geom, norm, eps, residual,
                swiglu: bool, glu: bool = False, rstd: bool = False,
                ssq_out: torch.Tensor | None = None, ssq_in: torch.Tensor | None = None,
                bulk: tuple[int, int, int] | None = None) -> torch.Tensor:
        """y [M, N] = residual + act(x) @ W.T through kernels/FILE.cu; x [M, K] ([M, 2K] with
        swiglu), the weight's arguments from _weight_args. glu: W is [gate; up] (N = 2I) and
        y [M, I] = silu(act(x) @ gate.T) * (act(x) @ up.T), no residual. rstd (bf16 kernel,
        plain x, with eps): y[m] scaled by rsqrt(mean(x[m]^2) + eps). ssq_out (plain x, with
        residual) float32 [M, ceil(N / 16)]: gets the sums of squares of the stored y per row
        and 16-column tile (16 weight rows); ssq_in (plain x, no residual, eps) float32
        [M, ceil(K / 16)]: such sums of x, y[m] scaled by rsqrt(sum(ssq_in[m]) / K + eps).
        bulk: the bulk setting of this launch instead of the kind's (where it has one)."""
        if norm is not None and swiglu:
            raise ValueError("a gemv prologue is an RMSNorm or a SwiGLU, not both")
        if rstd and (norm is not None or swiglu):
            raise ValueError("the row-scale RMSNorm (rstd) takes plain x (no RMSNorm or "
                             "SwiGLU prologue)")
        m, n, k = x.shape[0], w.shape[0], w.shape[1]
        _check_ssq(ssq_out, ssq_in, m, n, k, x.device, residual is not None,
                   norm is not None or swiglu or rstd, glu)
        if x.shape[1] != (2 * k if swiglu else k):
            raise ValueError(f"x {list(x.shape)} does not fit a weight [{n}, {k}]"
                             f"{' with the SwiGLU prologue (x [M, 2K])' if swiglu else ''}")
        if glu and (n % 16 or residual is not None or swiglu):
            raise ValueError(f"the SwiGLU epilogue takes a [gate; up] weight of 2I rows with "
                             f"I % 8 == 0 (got {n} rows), no residual and no SwiGLU prologue")
        y = _output(out, m, n // 2 if glu else n, x.device)
        if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
            raise ValueError(f"residual must be a contiguous [{m}, {n}], got "
                             f"{list(residual.shape)}")
        pro = RMSNORM if norm is not None else SWIGLU if swiglu else PLAIN
        pro |= RESIDUAL if residual is not None else 0
        pro |= GLU if glu else 0
        pro |= RSTD if rstd else 0
        pro |= SSQ if ssq_out is not None else 0
        pro |= RSTD_IN if ssq_in is not None else 0
        if geom is None and self.takes_bulk(file, pro, m, k, bulk):
            self._launch_bulk(file, x, w, y, m, n, k, residual, pro, norm, eps, setting=bulk)
            return y
        if geom is None and self.takes_ring(file, pro, m, k):
            self._launch_ring(file, x, w, y, m, n, k, residual, pro, norm, eps)
            return y
        mt = 1 if m <= 8 else 2
        variant = self.variant(file, n, k, mt)
        if geom is not None:  # (ks, tpb) or a full (ks, tpb, u, pf)
            variant = tuple(geom) if len(geom) == 4 else (*geom, *variant[2:])
        ks, tpb = variant[:2]
        fn = self._module(file, pro).get_function(kernel_name(file, mt, variant, pro))
        args = (*_weight_args(w), _p(x), _p(y), _i(m), _i(n), _i(k), _p(norm),
                np.float32(eps), _p(residual), _p(ssq_out), _p(ssq_in))
        self._run(fn, (math.ceil(n / (16 * tpb)),), (32 * ks * tpb,), args)
        return y

    # -- the three kernels on 2-D activations x [M, K] (contiguous, bf16) -----------------
    # Keywords (all kernels): norm [K] bf16 + eps: RMSNorm x first; swiglu: x [M, 2K] is
    # gate|up, SwiGLU it first; residual [M, N] bf16: added to the result (out may be it);
    # glu: W is [gate; up] and the result silu(gate) * up [M, N / 2]; ssq_out / ssq_in: the
    # sums of squares written / read (see _launch).
    def bf16(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
             geom: tuple | None = None, *, norm: torch.Tensor | None = None, eps: float = 0.0,
             swiglu: bool = False, residual: torch.Tensor | None = None,
             glu: bool = False, rstd: bool = False, ssq_out: torch.Tensor | None = None,
             ssq_in: torch.Tensor | None = None,
             bulk: tuple[int, int, int] | None = None) -> torch.Tensor:
        """x [M, K] @ w[N, K].T -> [M, N] bf16, M <= 16, K % 8 == 0."""
        return self._launch("gemv", x, w, out, geom, norm, eps, residual, swiglu, glu, rstd,
                            ssq_out, ssq_in, bulk)

    def int8(self, x: torch.Tensor, w: Int8Weight, out: torch.Tensor | None = None,
             geom: tuple | None = None, *, norm: torch.Tensor | None = None, eps: float = 0.0,
             swiglu: bool = False, residual: torch.Tensor | None = None,
             glu: bool = False, ssq_out: torch.Tensor | None = None,
             ssq_in: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ (q * scales).T -> [M, N] bf16, M <= 16, K % 16 == 0."""
        return self._launch("gemv_int8", x, w, out, geom, norm, eps, residual, swiglu, glu,
                            False, ssq_out, ssq_in)

    def int4(self, x: torch.Tensor, w: Int4Weight, out: torch.Tensor | None = None,
             geom: tuple | None = None, *, norm: torch.Tensor | None = None, eps: float = 0.0,
             swiglu: bool = False, residual: torch.Tensor | None = None,
             glu: bool = False, ssq_out: torch.Tensor | None = None,
             ssq_in: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ dequant(w).T -> [M, N] bf16, M <= 16, int4_fits(N, K)."""
        return self._launch("gemv_int4", x, w, out, geom, norm, eps, residual, swiglu, glu,
                            False, ssq_out, ssq_in)

    def dequantize(self, w: Int8Weight | Int4Weight) -> torch.Tensor:
        """The bf16 [N, K] weight of a quantized one, in one pass on the GPU (for prefill,
        then cuBLAS); bitwise equal to w.dequantize(torch.bfloat16)."""
        n, k = w.shape
        out = torch.empty(n, k, device=w.device, dtype=torch.bfloat16)
        items = n * k // 8
        grid = (max(1, min(math.ceil(items / 256), self.sms * 16)),)
        if isinstance(w, Int8Weight):
            file, name = "gemv_int8", "dequant_int8"
            args = (_p(w.q), _p(w.scales), _p(out), _i(n), _i(k))
        else:
            file, name = "gemv_int4", "dequant_int4"
            args = (_p(w.qweight_t), _p(w.qzeros), _p(w.scales), _p(out), _i(n), _i(k))
        fn = self._module(file).get_function(name)
        with self._cupy.cuda.Device(self.device_index):
            fn(grid, (256,), args, stream=self._stream())
        return out

    def launch(self, file: str, name: str, grid: tuple, block: tuple, args: tuple,
               pro: int = PLAIN) -> None:
        """Kernel `name` of kernels/FILE.cu (module of prologue `pro`) on torch's current
        stream (kestrel_rt/cuda/gemv_moe.py). Never with PDL: the expert kernels hit an
        illegal address under PDL on the H200 (2026-11-30; cause not found yet)."""
        fn = self._module(file, pro).get_function(name)
        self.carveout.apply(fn)
        with self._cupy.cuda.Device(self.device_index):
            fn(grid, block, args, stream=self._stream())

    def moe(self, x, weights, experts, gate_up, down, residual=None):
        """Routed experts through the expert-indexed gemv: see kestrel_rt/cuda/gemv_moe.py."""
        from kestrel_rt.cuda import gemv_moe

        return gemv_moe.moe(self, x, weights, experts, gate_up, down, residual=residual)

    def can_dequantize(self, w) -> bool:
        if isinstance(w, Int8Weight):
            return w.dim() == 2 and w.q.is_cuda and w.q.is_contiguous() and w.shape[1] % 8 == 0
        return (isinstance(w, Int4Weight) and w.dim() == 2 and w.qweight_t.is_cuda
                and w.qweight_t.is_contiguous() and w.scales.is_contiguous()
                and int4_fits(*w.shape))

    # -- dispatch ----------------------------------------------------------------------
    def supports(self, x2: torch.Tensor, w, k: int | None = None) -> bool:
        """True when a gemv kernel takes x2 [M, K] and weight w as they are (k: the weight's
        K when x2 is wider, as gate|up [M, 2K] for the SwiGLU prologue)."""
        m = x2.shape[0]
        k = x2.shape[1] if k is None else k
        if not (x2.is_cuda and x2.dtype == torch.bfloat16 and 0 < m <= MAX_ROWS
                and x2.is_contiguous() and x2.data_ptr() % 16 == 0):
            return False
        if w.dim() != 2 or (not isinstance(w, QuantizedWeight) and m > BF16_MAX_ROWS):
            return False
        return kernel_reads(w, w.shape[0], k)

    def takes_argmax(self, x: torch.Tensor, w, rstd: bool,
                     bulk: tuple[int, int, int] | None = None) -> bool:
        """True when `argmax` launches for x [M, K] and weight w (see there)."""
        return (isinstance(w, torch.Tensor) and x.dim() == 2 and w.dim() == 2
                and w.shape[1] == x.shape[1] and self.supports(x, w)
                and self.takes_bulk("gemv", RSTD if rstd else PLAIN, x.shape[0], x.shape[1],
                                    bulk))

    def argmax(self, x: torch.Tensor, w, *, rstd: bool, eps: float,
               state: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
               host: tuple[torch.Tensor, torch.Tensor] | None = None,
               bulk: tuple[int, int, int] | None = None) -> bool:
        """out [M] int64 <- the greedy choice of each row of x [M, K] over x @ W.T (W [N, K]
        bf16; rstd: each row of x scaled by its RMSNorm as fused(rstd=True, eps) scales it),
        over the results rounded to bf16 as `fused` stores them, with torch.argmax's ties and
        NaNs, in the bulk kernel itself (its ARGMAX epilogue: no y, no second launch): True.
        False, with nothing launched, where the bulk kernel does not take the launch (below
        sm_90, `bulk` off, more than bulk_max_rows rows, a weight or x it cannot read).
        state: (keys int64 [M], count int32 [1]), zeros, kept by the caller (the kernel leaves
        them at zero, so a captured graph replays); host: (pinned int64 [2, M], parity int64
        [1] on the device): the ids are also written to host[parity] (ops.argmax). bulk: this
        launch's bulk setting (as in `fused`)."""
        if not self.takes_argmax(x, w, rstd, bulk):
            return False
        m, k = x.shape
        keys, count = state
        if (keys.shape != (m,) or keys.dtype != torch.long or count.numel() < 1
                or count.dtype != torch.int32 or out.shape != (m,) or out.dtype != torch.long
                or not out.is_contiguous()):
            raise ValueError(f"argmax: keys {tuple(keys.shape)} {keys.dtype}, count "
                             f"{tuple(count.shape)} {count.dtype}, out {tuple(out.shape)} "
                             f"{out.dtype}: expected int64 [{m}], int32 [1], int64 [{m}]")
        check_host_out(host, m, x.device)
        pro = (RSTD if rstd else PLAIN) | ARGMAX
        buf, parity = (None, None) if host is None else host
        self._launch_bulk("gemv", x, w, None, m, w.shape[0], k, None, pro, None, eps,
                          (out, buf, parity, keys, count), setting=bulk)
        return True

    def fused(self, x: torch.Tensor, w, *, norm: torch.Tensor | None = None, eps: float = 0.0,
              swiglu: bool = False, residual: torch.Tensor | None = None,
              glu: bool = False, rstd: bool = False, ssq_out: torch.Tensor | None = None,
              ssq_in: torch.Tensor | None = None, bulk: tuple[int, int, int] | None = None
              ) -> torch.Tensor | None:
        """residual + act(x) @ W.T -> [..., N] bf16 in one kernel launch, or None when no
        kernel takes these inputs (rows, dtypes, alignment, K: see supports), so the caller
        composes the unfused ops.

        x [..., K], or gate|up [..., 2K] with swiglu; w [N, K] bf16 / Int8Weight /
        Int4Weight; norm [K] bf16: act = RMSNorm(x) * norm with eps (TorchBackend.rms_norm's
        rounding); swiglu: act = silu(gate) * up (TorchBackend.swiglu's); residual [..., N]
        bf16 added as torch's `residual + y` rounds; glu: w is [gate; up] (2I rows, I % 8 ==
        0) and the result silu(gate) * up [..., I], rounded as TorchBackend.swiglu of the
        linear (no residual); rstd: act = RMSNorm(x) with a unit weight (eps), applied as a
        per-row scale of the result (bf16 weights only: None for int8 / int4). ssq_out
        float32 [M, ceil(N / 16)] (M = prod(lead), with residual, plain x): also gets, per
        row m and 16-row tile p of the weight, the sum of the squares of the stored bf16
        results y[m, 16p:16p+16]. ssq_in float32 [M, ceil(K / 16)] (plain x, no residual, with
        eps; glu allowed): such sums of x's rows (an ssq_out of the kernel that wrote x), and
        act = RMSNorm(x) with a unit weight as a row scale, rstd[m] = rsqrt(sum(ssq_in[m]) /
        K + eps): the caller vouches that ssq_in describes x. bulk (bf16): this launch's
        bulk setting (WARPS, S, C) instead of `bulk`'s, where that is set (the o projection's
        deeper ring, CupyBackend.kind_bulk). Wrong shapes raise ValueError.
        """
        if norm is not None and swiglu:
            raise ValueError("fused takes an RMSNorm (norm) or a SwiGLU (swiglu), not both")
        lead, n, k = x.shape[:-1], w.shape[0], w.shape[-1]
        _check_ssq(ssq_out, ssq_in, math.prod(lead), n, k, x.device, residual is not None,
                   norm is not None or swiglu or rstd, glu)
        if (glu and n % 16) or (rstd and isinstance(w, QuantizedWeight)):
            return None
        x2 = x.reshape(-1, x.shape[-1])  # [M, K] or [M, 2K]; the kernel call checks widths
        if not self.supports(x2, w, k) or (norm is not None and not _is_bf16_vector(norm, k)):
            return None
        res2 = None
        if residual is not None:
            if residual.shape != (*lead, n):
                raise ValueError(f"residual {list(residual.shape)} must be {[*lead, n]}")
            if not (residual.is_cuda and residual.dtype == torch.bfloat16
                    and residual.is_contiguous()):
                return None
            res2 = residual.reshape(-1, n)  # [M, N]
        kw = {"norm": norm, "eps": eps, "swiglu": swiglu, "residual": res2, "glu": glu,
              "ssq_out": ssq_out, "ssq_in": ssq_in}
        if isinstance(w, Int8Weight):
            y = self.int8(x2, w, **kw)
        elif isinstance(w, Int4Weight):
            y = self.int4(x2, w, **kw)
        else:
            y = self.bf16(x2, w, rstd=rstd, bulk=bulk, **kw)
        return y.reshape(*lead, y.shape[-1])

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x [..., in] @ W.T -> [..., out]: kernel for <= 16 rows, else cuBLAS."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)  # [M, K]
        if self.supports(x2, w):
            if isinstance(w, Int8Weight):
                y = self.int8(x2, w)
            elif isinstance(w, Int4Weight):
                y = self.int4(x2, w)
            else:
                y = self.bf16(x2, w)
            return y.reshape(*lead, w.shape[0])
        if isinstance(w, QuantizedWeight):
            if x.dtype == torch.bfloat16 and self.can_dequantize(w):
                return F.linear(x, self.dequantize(w))
            return F.linear(x, w.dequantize(x.dtype))
        return F.linear(x, w)


def _setting(value, what: str, valid, expected: str) -> tuple[int, ...] | None:
    """A persistent-kernel setting checked: None, or a tuple of ints `valid` accepts
    (ValueError naming `what` and the `expected` form otherwise)."""
    if value is None:
        return None
    value = tuple(int(v) for v in value)
    if not valid(value):
        raise ValueError(f"{what} must be None or {expected}, got {value!r}")
    return value


def _ring_setting(value, what: str, file: str) -> tuple[int, int, int] | None:
    """A ring setting checked: None or (KSPLIT, S, blocks per SM) of a compiled variant."""
    return _setting(value, what,
                    lambda v: len(v) == 3 and v[:2] in RING_VARIANTS[file] and 1 <= v[2] <= 4,
                    f"(KSPLIT, S, blocks per SM) with (KSPLIT, S) one of "
                    f"{list(RING_VARIANTS[file])} and 1..4 blocks per SM")


def _persistent_takes(pro: int, m: int, k: int, stages_x: bool,
                      pros: tuple[int, ...] = RING_PROS) -> bool:
    """What a ring or bulk kernel asks of a launch, shared memory aside: a prologue it takes
    (one of pros), at most 8 rows of x (one n-tile), and x within RING_X_BYTES where the
    kernel stages it."""
    return pro in pros and m <= 8 and not (stages_x and m * k * 2 > RING_X_BYTES)


def file_of(w) -> str:
    """The kernels/ file whose kernels read weight `w`."""
    if isinstance(w, Int8Weight):
        return "gemv_int8"
    if isinstance(w, Int4Weight):
        return "gemv_int4"
    return "gemv"


def kernel_reads(w, n: int, k: int) -> bool:
    """True when the gemv kernels read weight w ([N, K], or experts [E, N, K]) as it is stored:
    on the device, dense, K (and N for int4) as the kernel's loads need them."""
    if isinstance(w, Int8Weight):
        return k % 16 == 0 and w.q.is_cuda and w.q.is_contiguous()
    if isinstance(w, Int4Weight):
        return (int4_fits(n, k) and w.qweight_t.is_cuda and w.qweight_t.is_contiguous()
                and w.scales.is_contiguous())
    return (isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.is_cuda
            and w.is_contiguous() and k % 8 == 0 and w.data_ptr() % 16 == 0)


def _output(out: torch.Tensor | None, m: int, n: int, device) -> torch.Tensor:
    """`out` checked to be a contiguous bf16 [m, n] on the device, or a new one."""
    if out is None:
        return torch.empty(m, n, device=device, dtype=torch.bfloat16)
    if out.shape != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [{m}, {n}], got {out.dtype} "
                         f"{list(out.shape)}")
    return out


def _check_ssq(ssq_out, ssq_in, m: int, n: int, k: int, device, residual: bool,
               prologue: bool, glu: bool) -> None:
    """ValueError unless the sums-of-squares buffers fit the call: ssq_out float32
    [m, ceil(n / 16)] with a residual, plain x and no SwiGLU epilogue; ssq_in float32
    [m, ceil(k / 16)] with plain x (no RMSNorm / SwiGLU prologue, no rstd) and no residual;
    both contiguous on x's device."""
    if ssq_out is not None and (not residual or prologue or glu):
        raise ValueError("ssq_out comes with a residual, plain x and no SwiGLU epilogue")
    if ssq_in is not None and (residual or prologue):
        raise ValueError("ssq_in takes plain x (no norm, swiglu or rstd) and no residual")
    for what, t, width in (("ssq_out", ssq_out, n), ("ssq_in", ssq_in, k)):
        want = (m, math.ceil(width / 16))
        if t is not None and not (isinstance(t, torch.Tensor) and t.dtype == torch.float32
                                  and tuple(t.shape) == want and t.is_contiguous()
                                  and t.device == device):
            raise ValueError(f"{what} must be a contiguous float32 {list(want)} on {device}, "
                             f"got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{list(getattr(t, 'shape', []))} on {getattr(t, 'device', '?')}")


def _is_bf16_vector(t: torch.Tensor, k: int) -> bool:
    """A norm weight the RMSNorm prologue reads: bf16 [k] on the GPU, 16-byte aligned."""
    return (t.is_cuda and t.dtype == torch.bfloat16 and t.shape == (k,) and t.is_contiguous()
            and t.data_ptr() % 16 == 0)


def _weight_args(w) -> tuple:
    """The leading kernel arguments of a weight (before x)."""
    if isinstance(w, Int8Weight):
        return _p(w.q), _p(w.scales)
    if isinstance(w, Int4Weight):
        return _p(w.qweight_t), _p(w.qzeros), _p(w.scales)
    return (_p(w),)


def _p(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (None -> null)."""
    return np.uint64(0 if t is None else t.data_ptr())


def _i(v: int) -> np.int32:
    return np.int32(v)


class GemvLinear:
    """Backend mixin: `linear` through one Gemv per backend instance (kernels for <= 16
    rows, cuBLAS beyond; bf16, Int8Weight and Int4Weight weights).

        class CupyBackend(GemvLinear, TorchBackend): ...
    """

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.gemv().linear(x, self.weight(name))

    def gemv(self) -> Gemv:
        """This backend's Gemv, made on first use (PDL when the backend's `pdl` is set); a
        bf16 backend keeps the bf16 ring only where it streams well on this device
        (Gemv.settle_ring) unless its `settle_ring` is False (other dtypes never run it)."""
        if getattr(self, "_gemv", None) is None:
            self._gemv = Gemv(self.device, pdl=getattr(self, "pdl", False))
            if (getattr(self, "settle_ring", True)
                    and getattr(self, "dtype", torch.bfloat16) == torch.bfloat16):
                self._gemv.settle_ring()
        return self._gemv
