"""How a model runs: one validated options object, given when its backend is built.

    options = default_options("cuda", shape, quant=None)          # what this device runs best
    options = default_options("cuda", shape, graphs=False)        # ... with one field changed
    model = build_model("qwen3-8b", "cuda", options=options)      # kestrel_rt/runner.py

`default_options` is the one place where defaults are chosen per device and model; every
field can be overridden there, and the result is checked against the device (a kernel path
the device cannot run is refused, not silently dropped). Nothing is set on a backend after it
is built. docs/kernels.md says what each kernel path is; docs/performance.md why these
defaults (the measurements and the commands that reproduce them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kestrel_sim.errors import KestrelError
from kestrel_sim.models import ModelShape

# Float dense models up to this hidden size have their RMSNorm weights folded into the next
# linears where the row scale runs in the tuned gemvs (below sm_90): faster for qwen3-0.6b
# (1024), slower for qwen3-8b (4096) there (docs/performance.md).
FOLD_DENSE_HIDDEN = 1024
DECODE_MIN_KEYS = 8  # keys per context split of the decode attention kernel, at least


class OptionsError(KestrelError):
    """Runtime options that do not fit the device or each other."""


class RuntimeOptions(BaseModel):
    """Everything a backend needs to know about how to run (frozen; extra keys refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["torch", "cupy"] = Field(
        default="torch", description="torch: the reference ops (any device); cupy: CUDA C "
        "kernels from kernels/ (a CUDA device and the cupy package)")
    graphs: bool = Field(default=False, description="cupy: replay decode / verify forwards "
                         "(M <= 16 new tokens per sequence) as CUDA graphs")
    pdl: bool = Field(default=False, description="cupy: launch kernels with programmatic "
                      "dependent launch (compute capability 9.0+)")
    bulk_gemv: bool = Field(default=False, description="cupy: bf16 decode gemvs (1-2 rows of "
                            "x) on the persistent bulk-copy kernel (compute capability 9.0+)")
    ring_gemv: bool = Field(default=False, description="cupy: bf16 decode gemvs (<= 8 rows) "
                            "on the persistent cp.async ring kernel where a load-time probe "
                            "shows it streams about as fast as the tuned kernel; ignored "
                            "where bulk_gemv takes the launch")
    fold_norms: bool = Field(default=False, description="fold each RMSNorm weight into the "
                             "linears that read its output; the norm then runs as a row scale "
                             "inside those kernels (float weights only)")
    moe_prefill_graphs: bool = Field(default=False, description="cupy, with graphs: replay "
                                     "a MoE model's one-sequence prefill chunks as CUDA graphs "
                                     "too, their experts past the MoE kernels' 64 tokens on the "
                                     "capture-safe grouped matmul (kestrel_rt/moe.py "
                                     "static_experts_forward; compute capability 9.0+)")
    mma_verify: bool = Field(default=False, description="cupy: verify attention (more "
                             "query rows per kv head than the decode kernel's 8) on the "
                             "tensor-core kernel (kernels/verify_attention.cu; bf16, head_dim "
                             "64 or 128, compute capability 8.0+) instead of attn_partial")
    mma_decode_min_batch: int | None = Field(default=None, ge=1, description="cupy, with "
                                             "mma_verify: decode-shaped attention (the decode "
                                             "kernel's 8 query rows per kv head or fewer) at "
                                             "this batch or more runs on attn_verify too, after "
                                             "qk_norm_rope and kv_write (None: never)")
    attention_min_keys: int = Field(default=DECODE_MIN_KEYS, ge=1, le=4096, description=
                                    "cupy: keys per context split of decode attention, at "
                                    "least")

    @model_validator(mode="after")
    def _cupy_only(self):
        if self.backend == "torch":
            on = [n for n in ("graphs", "pdl", "bulk_gemv", "ring_gemv", "moe_prefill_graphs",
                              "mma_verify") if getattr(self, n)]
            if on:
                raise ValueError(f"{', '.join(on)} need backend 'cupy' (the torch backend "
                                 "runs no kernels of its own)")
        if self.mma_decode_min_batch is not None and not self.mma_verify:
            raise ValueError("mma_decode_min_batch routes decode attention to the verify "
                             "kernel: it needs mma_verify")
        if self.moe_prefill_graphs and not self.graphs:
            raise ValueError("moe_prefill_graphs replays prefill chunks as CUDA graphs: it "
                             "needs graphs=True")
        return self


def cupy_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


def kernel_cache_dir() -> Path:
    """Where cupy keeps compiled kernels (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache)."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


def kernel_cache_filled() -> bool:
    """True when cupy's kernel cache holds compiled modules (a later run loads them)."""
    folder = kernel_cache_dir()
    return folder.is_dir() and any(folder.iterdir())


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability, or None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def fold_helps(shape: ModelShape, quant: str | None, bulk: bool) -> bool:
    """Whether folding the norms makes this model faster on the cupy backend: every float
    model where the bulk kernel applies the row scale; without it, MoE models and small dense
    ones (FOLD_DENSE_HIDDEN). Quantized models keep their norms (the int gemvs have no row
    scale)."""
    if quant not in (None, "none", "bf16"):
        return False
    return bulk or shape.is_moe or shape.hidden_size <= FOLD_DENSE_HIDDEN


# The batch from which decode steps run attn_verify by default: on the H200 (qwen3-8b, verify
# probe at e9f71a8) it was 0.97-1.01x the warp-per-key kernel at batches 1-2, 1.02x (context
# 512) to 1.19x (2048) at batch 4 and 2.6x at batch 64, context 2048. 3, not 4: a graph runs
# batch 3 in its bucket of 4, so eager steps of 3 take the same kernel as the graph's.
MMA_DECODE_MIN_BATCH = 3


def default_options(device: str | torch.device, shape: ModelShape | None = None,
                    quant: str | None = None, **overrides) -> RuntimeOptions:
    """The options this device runs `shape` (quantized as `quant`) fastest with, then
    `overrides` (field=value); checked against the device. CPU: the torch backend. CUDA with
    cupy: the cupy backend with graphs, and on compute capability 9.0+ PDL and the bulk-copy
    gemv, below it the ring gemv (kept only where it streams well); norms folded where that
    helps (fold_helps)."""
    device = torch.device(device)
    cc = compute_capability(device)
    backend = overrides.get("backend") or ("cupy" if cc and cupy_installed() else "torch")
    values: dict = {"backend": backend}
    if backend == "cupy" and cc is not None:
        hopper = cc >= (9, 0)
        values.update(graphs=True, pdl=hopper, bulk_gemv=hopper, ring_gemv=not hopper)
        if cc >= (8, 0):  # bf16 mma.sync: the tensor-core attention for verify and decode
            values.update(mma_verify=True, mma_decode_min_batch=MMA_DECODE_MIN_BATCH)
        if shape is not None:
            values["fold_norms"] = fold_helps(shape, quant, hopper)
    values.update(overrides)
    if not values.get("mma_verify") and "mma_decode_min_batch" not in overrides:
        values.pop("mma_decode_min_batch", None)  # mma_verify turned off: decode follows
    try:
        options = RuntimeOptions(**values)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}"
                             for e in err.errors())
        raise OptionsError(f"runtime options {values}: {problems}") from None
    check_device(options, device)
    return options


def check_device(options: RuntimeOptions, device: torch.device) -> None:
    """Refuse options this device cannot run, saying which field and why."""
    if options.backend == "torch":
        return
    cc = compute_capability(device)
    if cc is None:
        raise OptionsError(f"backend 'cupy' runs CUDA kernels, but the device is '{device}'; "
                           "use backend 'torch' (--backend torch) or a CUDA device")
    if not cupy_installed():
        raise OptionsError('backend \'cupy\' needs the cupy package: pip install -e ".[cuda13]" '
                           '(CUDA 13 driver) or ".[cuda12]", or use backend \'torch\'')
    if cc < (9, 0):
        hopper_only = [n for n in ("pdl", "bulk_gemv", "moe_prefill_graphs")
                       if getattr(options, n)]
        if hopper_only:
            raise OptionsError(f"{', '.join(hopper_only)} need compute capability 9.0 or newer; "
                               f"device {device} has {cc[0]}.{cc[1]}")
