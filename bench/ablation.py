"""Batch-1 decode step with each runtime feature on / off, same model (H200 ablation).

    python bench/ablation.py [--models qwen3-8b:bf16,qwen3-0.6b:bf16] [--pdl all,gemv,small,none]
                             [--late-trigger 0,1] [--fuse 0,1] [--glu 0,1] [--min-keys 8,32]
                             [--moe-early 0,1] [--moe-route 0,1] [--ring off,16.8.1]
                             [--ring-int4 off,16.8.1] [--bulk off,8.4.2048]
                             [--bulk-int4 off,8.4.2048] [--ring-norm 0,1] [--bulk-rstd 0,1]
                             [--carveout=-1,100] [--kernels-carveout=-1,100]
                             [--fold none,moe,all,producer] [--kind-bulk auto,same,o=8.6.2048]
                             [--breakdown]

Features (every combination of the values given is measured): pdl (programmatic dependent
launch: of every kernel, of the gemvs only, of the other kernels only, or of none), late
trigger (a tuned gemv lets the next kernel launch after its K loop, not at its top), fuse
(RMSNorm in the gemv prologue; off: its own kernel), glu (the SwiGLU in the gate_up gemv's
epilogue; off: its own kernel), min keys (keys per context split of the decode attention, at
least), moe early (moe_down issues its first weight loads before its PDL wait), moe route (the
routing inside moe_gate_up, no moe_route launch: CupyBackend.moe_fused_route), ring / ring
int4 (the bf16 / int4 decode gemvs through the persistent ring kernels of kernels/gemv_ring.cu,
KSPLIT.S.BPS: warps per block, shared-memory slots per thread, blocks per SM, or off;
Gemv.ring, Gemv.ring_int4), bulk / bulk int4 (the bf16 / int4 decode gemvs through the
bulk-copy kernels gemv_bulk_bf16 / gemv_bulk_int4, WARPS.S.C: consumer warps per block, slots,
bytes of each row per slot, ahead of the rings; Gemv.bulk, Gemv.bulk_int4), ring norm (the
RMSNorm before a linear inside the ring / bulk gemv's staging of x: CupyBackend.ring_norm),
bulk rstd (a folded norm's row-scale launches through the bulk kernel: Gemv.bulk_rstd),
carveout (the shared-memory percent every kernel asks for, -1 the driver's choice per kernel:
kestrel_rt/cuda/module.py Carveout), kernels carveout (the same for the non-gemv kernels only,
attention, norms: with 100 they run in the configuration the bulk and ring gemvs need, so those
can be placed beside them early under PDL) and fold (which
RMSNorm weights are folded into the next linears at load, kestrel_rt/fold.py, those norms
then a row scale inside the kernels, CupyBackend.norm_row_scale: none, moe (a MoE layer's
post-attention norm), all, producer (every norm folded, its rstd from the sums of squares the
residual gemv before it writes), or speed (what `kestrel generate` does); a model per value),
kind bulk (bulk settings by matmul kind, KIND=WARPS.S.C joined by +, e.g. o=8.6.2048+down=8.6.2048,
same: the --bulk one for every kind, or auto: the backend's default; CupyBackend.kind_bulk).
Prints tok/s (overlapped loop, bench/measure.py) and the median device time of a step for
each combination; --breakdown adds each model's per-kernel times with the build's defaults,
PDL on and off, and what each kernel adds to the step
(bench/measure.py frontier: with PDL a kernel's own duration includes its wait for the
previous one).
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

from kestrel_rt.cuda.gemv_variants import BULK_DEFAULT, RING_DEFAULT

PDL_MODES = {"all": (True, True), "gemv": (False, True), "small": (True, False),
             "none": (False, False)}


def flag(text: str) -> bool:
    return bool(int(text))


def ring(text: str) -> tuple | None:
    """A --ring value: "off" or KSPLIT.S.BPS."""
    return None if text == "off" else tuple(int(p) for p in text.split("."))


def kind_settings(text: str) -> dict | None:
    """A --kind-bulk value: "auto" (the backend's default, None), "same" (none) or
    KIND=WARPS.S.C joined by +."""
    if text == "auto":
        return None
    if text == "same":
        return {}
    return {k: ring(v) for k, v in (kv.split("=") for kv in text.split("+"))}


def kind_label(value: dict | None) -> str:
    if value is None:
        return "auto"
    return "+".join(f"{k}={ring_label(v)}" for k, v in value.items()) or "same"


def ring_label(value: tuple | None) -> str:
    return "off" if value is None else ".".join(map(str, value))


# The features: (keyword of set_features, command-line flag, default values, parser, how a
# value shows in the table).
FEATURES = (
    ("pdl", "--pdl", "all,none", str, str),
    ("late", "--late-trigger", "1", flag, str),
    ("fuse", "--fuse", "0", flag, str),
    ("glu", "--glu", "1,0", flag, str),
    ("min_keys", "--min-keys", "8", int, str),
    ("moe_early", "--moe-early", "1", flag, str),
    ("moe_route", "--moe-route", "0", flag, str),
    ("ring", "--ring", ring_label(RING_DEFAULT), ring, ring_label),
    ("ring_int4", "--ring-int4", "off", ring, ring_label),
    ("bulk", "--bulk", ring_label(BULK_DEFAULT), ring, ring_label),
    ("bulk_int4", "--bulk-int4", "off", ring, ring_label),
    ("ring_norm", "--ring-norm", "0", flag, str),
    ("bulk_rstd", "--bulk-rstd", "auto", lambda v: None if v == "auto" else flag(v), str),
    ("carveout", "--carveout", "-1", int, str),
    ("kernels_carveout", "--kernels-carveout", "-1", int, str),
    ("kind_bulk", "--kind-bulk", "auto", kind_settings, kind_label),
)


def set_features(model, pdl: str = "all", late: bool = True, fuse: bool = False,
                 glu: bool = True, min_keys: int = 8, moe_early: bool = True,
                 moe_route: bool = False, ring: tuple | None = RING_DEFAULT,
                 ring_int4: tuple | None = None, bulk: tuple | None = BULK_DEFAULT,
                 bulk_int4: tuple | None = None, ring_norm: bool = False,
                 bulk_rstd: bool | None = None, carveout: int = -1, kernels_carveout: int = -1,
                 kind_bulk: dict | None = None) -> None:
    """pdl: a key of PDL_MODES; late: the tuned gemvs' compile option (a new Gemv for the
    backend when it changes); the rest: the backend's and its Gemv's settings."""
    from kestrel_rt.cuda.linear import Gemv

    be = model.backend
    small, gemv = PDL_MODES[pdl]
    if ("-DGEMV_LATE_TRIGGER" in be.gemv().options) != late:
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
    be.gemv().ring = ring
    be.gemv().ring_int4 = ring_int4
    be.gemv().bulk = bulk
    be.gemv().bulk_int4 = bulk_int4
    be.ring_norm = ring_norm
    if bulk_rstd is not None:  # (None: the backend's choice)
        be.gemv().bulk_rstd = bulk_rstd
    be.kernels.carveout.percent = carveout if kernels_carveout == -1 else kernels_carveout
    be.gemv().carveout.percent = carveout
    be.kind_bulk = None if kind_bulk is None else dict(kind_bulk)
    model.graphs.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-8b:bf16,qwen3-0.6b:bf16,qwen3-8b:int4")
    for key, opt, default, _, _ in FEATURES:
        ap.add_argument(opt, dest=key, default=default, help=f"comma list (default {default})")
    ap.add_argument("--fold", default="speed", help="of speed,none,moe,all,producer")
    ap.add_argument("--breakdown", action="store_true")
    args = ap.parse_args()
    values = {key: [parse(v) for v in getattr(args, key).split(",")]
              for key, _, _, parse, _ in FEATURES}
    show = {key: label for key, _, _, _, label in FEATURES}
    grid = [dict(zip(values, combo)) for combo in itertools.product(*values.values())]
    gen = torch.Generator().manual_seed(0)
    rows, breakdowns = [], []
    for spec, fold in itertools.product(args.models.split(","), args.fold.split(",")):
        name, quant = spec.split(":")
        model = build(name, quant, fold=fold)
        model.allocate_kv(1, 2048 + 64)
        for features in grid:
            set_features(model, **features)
            r = measure.time_steps(model, 1, 1, CONTEXT, 48, gen)
            shown = {k: show[k](v) for k, v in features.items()}
            rows.append((name, quant, fold, *shown.values(), r["tok_s"], r["ms"]))
            print(f"{name} {quant} fold={fold} "
                  + " ".join(f"{k}={v}" for k, v in shown.items())
                  + f": {r['tok_s']:.1f} tok/s, step {r['ms']:.3f} ms", flush=True)
        if args.breakdown:  # this build's defaults, PDL on and off
            for pdl in ("all", "none"):
                set_features(model, pdl=pdl)
                breakdowns.append((f"{spec} fold={fold}, PDL {'off' if pdl == 'none' else 'on'}",
                                   measure.kernel_breakdown(model, CONTEXT)))
        del model
        torch.cuda.empty_cache()
    for spec, b in breakdowns:
        print(f"\n{spec}: step {b['step_ms']:.3f} ms, kernels busy {b['busy_ms']:.3f} ms")
        print("\n".join(measure.breakdown_table(b)))
    header = ["model", "quant", "fold", *(opt.lstrip("-") for _, opt, _, _, _ in FEATURES),
              "tok/s", "step ms"]
    print("\n| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r[:-2]) + f" | {r[-2]:.1f} | {r[-1]:.3f} |")


if __name__ == "__main__":
    main()
