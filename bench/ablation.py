"""Batch-1 decode step with each runtime feature on / off, same model (H200 ablation).

    python bench/ablation.py [--models qwen3-8b:bf16,qwen3-0.6b:bf16] [--pdl all,gemv,small,none]
                             [--fuse 0,1] [--glu 0,1] [--late-trigger 0,1]
                             [--min-keys 8,32] [--fold none,moe,all,producer] [--moe-early 0,1]
                             [--moe-route 0,1] [--norm-early 0,1]
                             [--ring off,16.8.1] [--ring-int4 off,16.8.1] [--ring-norm 0,1]
                             [--carveout=-1,100] [--breakdown]

Features: pdl (programmatic dependent launch: of every kernel, of the gemvs only, of the
other kernels only, or of none), late trigger (a gemv lets the next kernel launch after its
K loop, not at its top), fuse (RMSNorm in the gemv prologue; off: its own kernel), min keys
(keys per context split of the decode attention, at least), glu (the SwiGLU in the gate_up
gemv's epilogue; off: its own kernel), moe early (moe_down issues its first weight loads
before its PDL wait), moe route (the routing inside moe_gate_up, no moe_route launch:
CupyBackend.moe_fused_route), norm early (the rmsnorm kernel's weight loaded before its PDL
wait: CupyBackend.norm_early), ring / ring int4 (the bf16 / int4 decode gemvs through the
persistent ring kernels of kernels/gemv_ring.cu, KSPLIT.S.BPS: warps per block, shared-memory
slots per thread, blocks per SM; Gemv.ring, Gemv.ring_int4), ring norm (the RMSNorm before a
linear inside the ring gemv's staging of x: CupyBackend.ring_norm), carveout (the shared-memory percent every kernel asks
for, -1 the driver's choice per kernel: kestrel_rt/cuda/module.py Carveout) and fold (which RMSNorm weights are folded into the next
linears at load, kestrel_rt/fold.py, those norms then a row scale inside the kernels,
CupyBackend.norm_row_scale: none, moe (a MoE layer's post-attention norm), all, producer
(every norm folded, its rstd from the sums of squares the residual gemv before it writes),
or speed (what `kestrel generate` does); a model per value). Prints tok/s (overlapped loop,
bench/measure.py) and the median device time of a step for each combination;
--breakdown adds each model's per-kernel times with PDL on and off, and what each kernel adds
to the step (bench/measure.py frontier: with PDL a kernel's own duration includes its wait
for the previous one).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure
from h200_decode import CONTEXT, build

from kestrel_rt.cuda.gemv_variants import RING_DEFAULT

PDL_MODES = {"all": (True, True), "gemv": (False, True), "small": (True, False),
             "none": (False, False)}


def set_features(model, pdl: str, late: bool, fuse: bool, glu: bool, min_keys: int = 8,
                 moe_early: bool = True, moe_route: bool = False,
                 norm_early: bool = False, ring: tuple | None = RING_DEFAULT,
                 carveout: int = -1, ring_int4: tuple | None = None,
                 ring_norm: bool = False) -> None:
    """pdl: a key of PDL_MODES; late: the gemvs' compile option (a new Gemv for the backend
    when it changes)."""
    from kestrel_rt.cuda.linear import Gemv

    be = model.backend
    small, gemv = PDL_MODES[pdl]
    opts = be.gemv().options
    if ("-DGEMV_LATE_TRIGGER" in opts) != late:
        be._gemv = Gemv(be.device, pdl=True, late_trigger=late)
    if (small and be.kernels.pdl is None) or (gemv and be.gemv()._pdl is None):
        raise RuntimeError("this backend was built without PDL")
    be.kernels.pdl_enabled = small
    be.gemv().pdl_enabled = gemv
    be.fuse_prologues = fuse
    be.decode_min_keys = min_keys
    be.glu_epilogue = glu
    be.moe_early = moe_early
    be.moe_fused_route = moe_route
    be.norm_early = norm_early
    be.gemv().ring = ring
    be.gemv().ring_int4 = ring_int4
    be.ring_norm = ring_norm
    be.kernels.carveout.percent = carveout
    be.gemv().carveout.percent = carveout
    model.graphs.clear()


def rings(text: str) -> list[tuple | None]:
    """--ring's values: "off" or KSPLIT.S.BPS."""
    return [None if v == "off" else tuple(int(p) for p in v.split(".")) for v in text.split(",")]


def flags(text: str) -> list[bool]:
    return [bool(int(v)) for v in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-8b:bf16,qwen3-0.6b:bf16,qwen3-8b:int4")
    ap.add_argument("--pdl", default="all,none", help="of " + ",".join(PDL_MODES))
    ap.add_argument("--late-trigger", default="1")
    ap.add_argument("--fuse", default="0")
    ap.add_argument("--glu", default="1,0")
    ap.add_argument("--min-keys", default="8")
    ap.add_argument("--fold", default="speed", help="of speed,none,moe,all,producer")
    ap.add_argument("--moe-early", default="1")
    ap.add_argument("--moe-route", default="0")
    ap.add_argument("--norm-early", default="0", help="rmsnorm's weight before its wait")
    ap.add_argument("--ring", default=".".join(map(str, RING_DEFAULT)),
                    help="bf16: off or KSPLIT.S.BPS (gemv_ring.cu)")
    ap.add_argument("--ring-int4", default="off", help="int4: off or KSPLIT.S.BPS")
    ap.add_argument("--ring-norm", default="0", help="RMSNorm inside the ring gemv")
    ap.add_argument("--carveout", default="-1", help="shared-memory percent, -1: driver's")
    ap.add_argument("--breakdown", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows, breakdowns = [], []
    grid = list(itertools.product(args.pdl.split(","), flags(args.late_trigger),
                                  flags(args.fuse), flags(args.glu),
                                  [int(v) for v in args.min_keys.split(",")],
                                  flags(args.moe_early), flags(args.moe_route),
                                  flags(args.norm_early), rings(args.ring),
                                  [int(v) for v in args.carveout.split(",")],
                                  rings(args.ring_int4), flags(args.ring_norm)))
    for spec, fold in itertools.product(args.models.split(","), args.fold.split(",")):
        name, quant = spec.split(":")
        model = build(name, quant, fold=fold)
        model.allocate_kv(1, 2048 + 64)
        for pdl, late, fuse, glu, keys, early, route, norm, ring, carve, ring4, rnorm in grid:
            set_features(model, pdl, late, fuse, glu, keys, early, route, norm, ring, carve,
                         ring4, rnorm)
            r = measure.time_steps(model, 1, 1, CONTEXT, 48, gen)
            ring_s = "/".join("off" if v is None else ".".join(map(str, v)) for v in (ring, ring4))
            ring_s += " norm" if rnorm else ""
            rows.append((name, quant, fold, pdl, late, fuse, glu, keys, early, route, norm,
                         ring_s, carve, r["tok_s"], r["ms"]))
            print(f"{name} {quant} fold={fold} pdl={pdl} late={late} fuse={fuse} "
                  f"glu={glu} keys={keys} moe_early={early} moe_route={route} "
                  f"norm_early={norm} ring={ring_s} carveout={carve}: "
                  f"{r['tok_s']:.1f} tok/s, "
                  f"step {r['ms']:.3f} ms",
                  flush=True)
        if args.breakdown:  # this build's defaults, with PDL on and off
            for pdl in ("all", "none"):
                set_features(model, pdl, True, False, True, ring=rings(args.ring)[-1],
                             carveout=int(args.carveout.split(",")[-1]),
                             ring_int4=rings(args.ring_int4)[-1],
                             ring_norm=flags(args.ring_norm)[-1])
                breakdowns.append((f"{spec} fold={fold}, PDL {'off' if pdl == 'none' else 'on'}",
                                   measure.kernel_breakdown(model, CONTEXT)))
        del model
        torch.cuda.empty_cache()
    for spec, b in breakdowns:
        print(f"\n{spec}: step {b['step_ms']:.3f} ms, kernels busy {b['busy_ms']:.3f} ms")
        print("\n".join(measure.breakdown_table(b)))
    print("\n| model | quant | fold | pdl | late trigger | fuse | glu | min keys | "
          "moe early | moe route | norm early | ring bf16/int4 | carveout | tok/s | step ms |\n"
          "| --- | --- | --- | --- | --- | --- | --- | ---: | --- | --- | --- | --- | ---: | ---: "
          "| ---: |")
    for r in rows:
        print("| " + " | ".join(str(v) for v in r[:13]) + f" | {r[13]:.1f} | {r[14]:.3f} |")


if __name__ == "__main__":
    main()
