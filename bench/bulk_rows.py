"""Forwards of M new tokens through the bulk-copy gemvs and through the tuned ones, per M.

Batch 1, 128 cached tokens: where the bulk kernel stops paying (Gemv.bulk_max_rows).

    python bench/bulk_rows.py [--model qwen3-8b] [--rows 1,2,3,4,5] [--reps 2]

Each forward is a verify-shaped step (GraphModel, CUDA graphs, bench/measure.py time_steps:
median device time); "bulk" routes every launch of up to 8 rows that the bulk kernel takes to
it, "tuned" switches the bulk kernel and the cp.async ring off.
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

from kestrel_rt.cuda.gemv_variants import BULK_DEFAULT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--rows", default="1,2,3,4,5")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    model = build(args.model, "bf16")
    model.allocate_kv(1, 2048 + 64)
    gen = torch.Generator().manual_seed(0)
    gemv = model.backend.gemv()
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.reps):
        for label, bulk in (("bulk", BULK_DEFAULT), ("tuned", None)):
            gemv.bulk, gemv.ring, gemv.bulk_max_rows = bulk, None, 8
            model.graphs.clear()
            for m in rows:
                ms = measure.time_steps(model, 1, m, CONTEXT, 24, gen)["ms"]
                times.setdefault((label, m), []).append(ms)
                print(f"{label} M={m}: {ms:.3f} ms", flush=True)
    print(f"\n{args.model} bf16, batch 1, {CONTEXT} cached tokens: ms per forward "
          f"(each of {args.reps} runs)")
    print(f"{'M':>3} {'bulk':>16} {'tuned':>16}")
    for m in rows:
        cells = [" ".join(f"{t:7.3f}" for t in times[(label, m)]) for label in ("bulk", "tuned")]
        print(f"{m:3d} {cells[0]:>16} {cells[1]:>16}")


if __name__ == "__main__":
    main()
