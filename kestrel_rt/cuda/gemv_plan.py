"""Which skinny-matmul kernel a launch takes: one table from weight kind and shape to kernel.

    plan("bf16", RESIDUAL, rows=1, n=4096, k=4096, matmul="o", device=dev, tuned=tuned)
      -> Plan("bulk", (8, 6, 2048))

In order, for a launch of `rows` rows of x against an [n, k] weight of kind bf16 / int8 /
int4 with prologue and epilogue bits `pro` (kernels/gemv_mma.cuh):

| kernel | takes | setting |
| --- | --- | --- |
| bulk (kernels/gemv_bulk.cu) | bf16, device.bulk, rows <= BULK_MAX_ROWS, x within RING_X_BYTES, a prologue it has (the row-scale RMSNorm only where device.bulk_rstd), or ARGMAX | BULK_AFTER_ATTENTION for the o projection at one row where the weight has more 16-row tiles than SMs, else BULK_DEFAULT |
| ring (kernels/gemv_ring.cu) | bf16, device.ring and not device.bulk, rows <= 8, x within RING_X_BYTES, a prologue it has | RING_DEFAULT |
| tuned (kernels/gemv*.cu) | everything else the kernels read (rows <= 16; bf16 <= 8) | the sweep's variant for (kind, n, k, n-tiles), else default_variant |

Both persistent kernels also need their shared memory within the device's limit. Rows past
what the tuned kernels take go to cuBLAS; that is the caller's choice (Gemv.supports), not a
plan. Nothing here touches a GPU: the table is tested on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kestrel_rt.cuda.gemv_variants import (
    ARGMAX,
    BULK_AFTER_ATTENTION,
    BULK_DEFAULT,
    BULK_MAX_ROWS,
    BULK_RSTD_PROS,
    FILES_OF,
    RING_DEFAULT,
    RING_PROS,
    RING_X_BYTES,
    RSTD,
    bulk_shared_bytes,
    bulk_static_bytes,
    default_variant,
    ring_shared_bytes,
    ring_static_bytes,
)

Kind = Literal["bf16", "int8", "int4"]


@dataclass(frozen=True)
class GemvDevice:
    """What the table needs to know about the device and the model's options."""

    sms: int  # multiprocessors
    max_shared: int  # shared bytes one block may have (opt-in limit)
    bulk: bool  # the bulk-copy kernel runs (RuntimeOptions.bulk_gemv, sm_90+)
    ring: bool  # the ring kernel runs (RuntimeOptions.ring_gemv, and it streams well here)
    bulk_rstd: bool = True  # row-scale RMSNorm launches may take the bulk kernel (not MoE)


@dataclass(frozen=True)
class Plan:
    kernel: Literal["bulk", "ring", "tuned"]
    setting: tuple[int, ...]  # bulk (WARPS, S, C), ring (KSPLIT, S, BPS), tuned (KS, TPB, U, PF)


def bulk_setting(pro: int, rows: int, n: int, matmul: str | None, device: GemvDevice
                 ) -> tuple[int, int, int] | None:
    """The bulk kernel's setting for this launch, or None where it does not take it."""
    pros = RING_PROS + (ARGMAX,) + (BULK_RSTD_PROS + (RSTD | ARGMAX,) if device.bulk_rstd
                                    else ())
    if not device.bulk or rows > BULK_MAX_ROWS or pro not in pros:
        return None
    after_attention = matmul == "o" and rows == 1 and math.ceil(n / 16) > device.sms
    return BULK_AFTER_ATTENTION if after_attention else BULK_DEFAULT


def plan(kind: Kind, pro: int, rows: int, n: int, k: int, matmul: str | None,
         device: GemvDevice, tuned: dict) -> Plan:
    """The kernel and setting of one launch (see the module docstring). matmul: the weight's
    kind within a layer (qkv, o, gate_up, down, lm_head, router) or None."""
    stages_x = rows * k * 2 <= RING_X_BYTES
    if kind == "bf16" and stages_x:
        setting = bulk_setting(pro, rows, n, matmul, device)
        if setting is not None and (bulk_shared_bytes(*setting, rows, k)
                                    + bulk_static_bytes(*setting[:2]) <= device.max_shared):
            return Plan("bulk", setting)
        if device.ring and not device.bulk and rows <= 8 and pro in RING_PROS:
            ks, slots, _ = RING_DEFAULT
            if ring_shared_bytes(ks, slots, rows, k) + ring_static_bytes(ks) <= device.max_shared:
                return Plan("ring", RING_DEFAULT)
    return Plan("tuned", tuned_variant(kind, rows, n, k, device.sms, tuned))


def tuned_variant(kind: Kind, rows: int, n: int, k: int, sms: int, tuned: dict
                  ) -> tuple[int, int, int, bool]:
    """The tuned kernels' variant for this launch: the sweep's for (kind, n, k, n-tiles),
    else default_variant."""
    file = FILES_OF[kind]
    mt = 1 if rows <= 8 else 2
    return tuned.get((file, n, k, mt)) or default_variant(file, n, k, sms)
