"""Batch-1 decode step with each runtime feature on / off, same model (H200 ablation).

    python bench/ablation.py [--models qwen3-8b:bf16,qwen3-0.6b:bf16]

Features: pdl (programmatic dependent launch of the kernels), fuse (RMSNorm in the gemv
prologue; off: its own kernel) and glu (the SwiGLU in the gate_up gemv's epilogue; off: its
own kernel). Prints tok/s (overlapped loop, bench/measure.py) and the median device time of
a step for each combination.
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


def set_features(model, pdl: bool, fuse: bool, glu: bool) -> None:
    be = model.backend
    if pdl and be.kernels.pdl is None or pdl and be.gemv()._pdl is None:
        raise RuntimeError("this backend was built without PDL")
    be.kernels.pdl_enabled = pdl
    be.gemv().pdl_enabled = pdl
    be.fuse_prologues = fuse
    be.glu_epilogue = glu
    model.graphs.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-8b:bf16,qwen3-0.6b:bf16,qwen3-8b:int4")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for spec in args.models.split(","):
        name, quant = spec.split(":")
        model = build(name, quant)
        model.allocate_kv(1, 2048 + 64)
        for pdl, fuse, glu in itertools.product((True, False), repeat=3):
            set_features(model, pdl, fuse, glu)
            r = measure.time_steps(model, 1, 1, CONTEXT, 48, gen)
            rows.append((name, quant, pdl, fuse, glu, r["tok_s"], r["ms"]))
            print(f"{name} {quant} pdl={pdl} fuse={fuse} glu={glu}: {r['tok_s']:.1f} tok/s, "
                  f"step {r['ms']:.3f} ms", flush=True)
        del model
        torch.cuda.empty_cache()
    print("\n| model | quant | pdl | fuse | glu | tok/s | step ms |\n"
          "| --- | --- | --- | --- | --- | ---: | ---: |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.1f} | {r[6]:.3f} |")


if __name__ == "__main__":
    main()
