"""Batch-1 decode with the backend's own choice of bf16 gemv kernel (Gemv.settle_ring).

    python bench/ring_probe.py [--models qwen3-8b:bf16,qwen3-8b:int4]

For each model: the probe's times (ring kernel, tuned kernel: microseconds per [4096, 4096]
product, kestrel_rt/cuda/linear.py Gemv.probe_ring; none while the bulk kernel is set, the
default on sm_90), the ring and bulk settings, and the
median device time of a decode step at 128 cached tokens (bench/measure.py time_steps).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure
from h200_decode import CONTEXT, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-8b:bf16,qwen3-8b:int4",
                    help="comma list of preset:quant")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    for spec in args.models.split(","):
        name, quant = spec.split(":")
        model = build(name, quant, fold="speed")
        model.allocate_kv(1, 2048 + 64)
        gemv = model.backend.gemv()  # made and settled here
        r = measure.time_steps(model, 1, 1, CONTEXT, 48, gen)
        ring_us, tuned_us = gemv.ring_probe_us or (float("nan"), float("nan"))
        print(f"{name} {quant}: probe ring {ring_us:.2f} us, tuned {tuned_us:.2f} us -> "
              f"ring {gemv.ring}, bulk {gemv.bulk}; step {r['ms']:.3f} ms, "
              f"{r['tok_s']:.1f} tok/s", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
