"""Batch-1 decode step with runtime options changed one grid at a time, same model.

    python bench/ablation.py [--models qwen3-8b:bf16,qwen3-0.6b:bf16]
                             [--set pdl=true,false --set fold_norms=true,false] [--breakdown]

Each --set names a field of kestrel_rt.options.RuntimeOptions and the values to try; every
combination is measured on a model built by kestrel_rt/runner.py with the device's default
options and that combination on top (a model per combination). Prints tok/s (overlapped
greedy loop, bench/measure.py) and the median device time of a step, then a table;
--breakdown adds each model's per-kernel times with the default options.
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

from kestrel_rt.options import RuntimeOptions


def parse_set(text: str) -> tuple[str, list]:
    """'pdl=true,false' -> ('pdl', [True, False]) (values parsed by the field's type)."""
    key, _, values = text.partition("=")
    if key not in RuntimeOptions.model_fields:
        raise SystemExit(f"--set {text}: '{key}' is not a RuntimeOptions field "
                         f"({', '.join(RuntimeOptions.model_fields)})")
    kind = RuntimeOptions.model_fields[key].annotation
    parse = {bool: lambda v: v.lower() in ("1", "true", "on"), int: int}.get(kind, str)
    return key, [parse(v) for v in values.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-8b:bf16,qwen3-0.6b:bf16,qwen3-8b:int4")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="FIELD=V1,V2 (repeatable)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--breakdown", action="store_true")
    args = ap.parse_args()
    grid_values = dict(parse_set(s) for s in args.sets)
    grid = [dict(zip(grid_values, combo)) for combo in itertools.product(*grid_values.values())]
    gen = torch.Generator().manual_seed(0)
    rows, breakdowns = [], []
    for spec in args.models.split(","):
        name, quant = spec.split(":")
        for changes in grid:
            model = build(name, quant, **changes)
            model.allocate_kv(1, 2048 + 64)
            r = measure.time_steps(model, 1, 1, CONTEXT, args.steps, gen)
            shown = " ".join(f"{k}={v}" for k, v in changes.items()) or "defaults"
            rows.append((name, quant, shown, r["tok_s"], r["ms"]))
            print(f"{name} {quant} {shown}: {r['tok_s']:.1f} tok/s, step {r['ms']:.3f} ms",
                  flush=True)
            if args.breakdown and changes == grid[0]:
                breakdowns.append((spec, measure.kernel_breakdown(model, CONTEXT)))
            del model
            torch.cuda.empty_cache()
    for spec, b in breakdowns:
        print(f"\n{spec}: step {b['step_ms']:.3f} ms, kernels busy {b['busy_ms']:.3f} ms")
        print("\n".join(measure.breakdown_table(b)))
    print("\n| model | quant | options | tok/s | step ms |\n| --- | --- | --- | ---: | ---: |")
    for name, quant, shown, tok_s, ms in rows:
        print(f"| {name} | {quant} | {shown} | {tok_s:.1f} | {ms:.3f} |")


if __name__ == "__main__":
    main()
