"""Bandwidth of the gemv kernels alone (GB/s against the measured device copy bandwidth).

    python bench/gemv_bench.py [--out DIR]
    python bench/gemv_bench.py --sweep --out DIR   # every launch variant; writes the best
                                                   # per shape as DIR/gemv_tuned.json
    python bench/gemv_bench.py --kinds bf16,int4 --ms 1 --paths table,tuned,bulk,ring [--pdl]
                                                   # bf16 through each kernel too


For each kernel (bf16, int8, int4, and torch's own F.linear on bf16), each path (the plan
table's choice, kestrel_rt/cuda/gemv_plan.py, or bf16 forced through the tuned, bulk or ring
kernel) and each qwen3-8b decode shape at M = 1, 4 and 16: one CUDA graph calls the kernel on enough distinct weight copies
to stream >= 1.5 GB (so the 60 MB L2 holds nothing between calls); replays are timed with
CUDA events, median of 10. "layer stream" runs all four projections of 36 layers in one
graph, what a qwen3-8b decode step reads. Bytes counted: weights + scales + activations in +
outputs, each once. Prints a table last; writes gemv_bench.json to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import copy_bandwidth, time_graph

from kestrel_rt.cuda.gemv import Gemv, gemv_device
from kestrel_rt.cuda.gemv_plan import Plan, tuned_variant
from kestrel_rt.cuda.gemv_variants import (
    BULK_DEFAULT,
    FILES_OF,
    RING_DEFAULT,
    all_variants,
)
from kestrel_rt.options import default_options
from kestrel_rt.quant_weights import Int4Weight, Int8Weight

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
             "down": (4096, 12288), "lm_head": (151936, 4096)}
STREAM_BYTES = 1.5e9
# decode shapes (N, K) of the benchmark's models: qwen3-8b, qwen3-0.6b, qwen3-30b-a3b attention
SWEEP_SHAPES = sorted(set(SHAPES_8B.values()) | {
    (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),  # 0.6b
    (5120, 2048), (2048, 4096), (151936, 2048),  # 30b-a3b attention, lm_head
})


def random_weight(kind: str, n: int, k: int, gen: torch.Generator):
    """A weight of `kind` with random contents, made directly (no quantization pass)."""
    dev = "cuda"
    if kind in ("bf16", "torch"):
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8, generator=gen)
        return Int8Weight(q, torch.rand(n, device=dev, generator=gen) * 1e-3, shape=(n, k))
    qw = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int32,
                       generator=gen)
    qz = torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), device=dev, dtype=torch.int32,
                       generator=gen)
    sc = (torch.rand(k // 128, n, device=dev, generator=gen) * 1e-2).half()
    return Int4Weight(qw, qz, sc, shape=(n, k))


def weight_bytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def chosen(gemv: Gemv, path: str, w, m: int) -> Plan | None:
    """The plan of a launch on `path`: None (the table's), or a kernel forced."""
    if path == "table":
        return None
    if path == "bulk":
        return Plan("bulk", BULK_DEFAULT)
    if path == "ring":
        return Plan("ring", RING_DEFAULT)
    n, k = w.shape
    return Plan("tuned", tuned_variant("bf16", m, n, k, gemv.sms, gemv.tuned))


def call(gemv: Gemv, kind: str, x: torch.Tensor, w, out: torch.Tensor,
         path: str = "table") -> None:
    if kind == "torch":
        torch.matmul(x, w.T, out=out)
    else:
        gemv.matmul(x, w, out=out, chosen=chosen(gemv, path, w, x.shape[0]))


def bench_shape(gemv, kind, name, n, k, m, gen, path="table") -> dict:
    w0 = random_weight(kind, n, k, gen)
    per = weight_bytes(w0) + 2 * m * (k + n)
    copies = max(2, min(64, math.ceil(STREAM_BYTES / per)))
    ws = [w0] + [random_weight(kind, n, k, gen) for _ in range(copies - 1)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]

    def run():
        for w, o in zip(ws, outs):
            call(gemv, kind, x, w, o, path)

    t = time_graph(run) / copies
    return {"kernel": kind, "shape": name, "m": m, "n": n, "k": k, "us": t * 1e6,
            "bytes": per, "gbps": per / t / 1e9}


def bench_layers(gemv, kind, m, gen, layers: int = 36, path="table") -> dict:
    """All projections of `layers` qwen3-8b layers in one graph: a decode step's weights."""
    mats = [(n, k) for name, (n, k) in SHAPES_8B.items() if name != "lm_head"]
    ws = [random_weight(kind, n, k, gen) for _ in range(layers) for n, k in mats]
    per = sum(weight_bytes(w) + 2 * m * (w.shape[0] + w.shape[1]) for w in ws)
    xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
          for k in {k for _, k in mats}}
    outs = [torch.empty(m, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]

    def run():
        for w, o in zip(ws, outs):
            call(gemv, kind, xs[w.shape[1]], w, o, path)

    t = time_graph(run)
    return {"kernel": kind, "shape": f"{layers} layers", "m": m, "n": 0, "k": 0,
            "us": t * 1e6, "bytes": per, "gbps": per / t / 1e9}


def sweep(gemv: Gemv, kinds: list[str], gen, copy_bw: float) -> dict:
    """Time every variant on every SWEEP_SHAPES shape at M = 1 and 16; keep the best."""
    best, everything = [], []
    for kind in kinds:
        file = FILES_OF[kind]
        for n, k in SWEEP_SHAPES:
            w0 = random_weight(kind, n, k, gen)
            per_w = weight_bytes(w0)
            copies = max(2, min(64, math.ceil(0.8e9 / per_w)))
            ws = [w0] + [random_weight(kind, n, k, gen) for _ in range(copies - 1)]
            for m in (1, 16):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
                per = per_w + 2 * m * (k + n)
                results = []
                for variant in all_variants(file):
                    def run(variant=variant, ws=ws, outs=outs, x=x):
                        for w, o in zip(ws, outs):
                            gemv.matmul(x, w, out=o, chosen=Plan("tuned", variant))
                    t = time_graph(run, reps=5) / copies
                    results.append((t, variant))
                    everything.append({"file": file, "n": n, "k": k, "m": m,
                                       "variant": list(variant), "us": t * 1e6})
                t, variant = min(results)
                best.append({"file": file, "n": n, "k": k, "mt": 1 if m <= 8 else 2,
                             "variant": list(variant), "us": t * 1e6, "gbps": per / t / 1e9,
                             "of_copy": per / t / copy_bw})
                print(json.dumps(best[-1]), flush=True)
            ws = outs = None
            torch.cuda.empty_cache()
    return {"best": best, "all": everything}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--kinds", default="bf16,int8,int4,torch")
    parser.add_argument("--ms", default="1,4,16")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--paths", default="table",
                        help="table (the plan's kernel), tuned, bulk, ring: a comma list; "
                             "bulk and ring are bf16 only")
    parser.add_argument("--pdl", action="store_true",
                        help="launch with programmatic dependent launch (consecutive calls "
                             "overlap)")
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    device = torch.device("cuda")
    defaults = default_options(device, backend="cupy")  # the kernels the runtime picks here
    target = gemv_device(device, bulk=defaults.bulk_gemv, ring=defaults.ring_gemv)
    gemv = Gemv(device, target, sweep=args.sweep, pdl=args.pdl)
    gemv.compile()
    copy_bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        kinds = [k for k in args.kinds.split(",") if k != "torch"]
        found = sweep(gemv, kinds, gen, copy_bw)
        found.update(device=props.name, copy_gbps=copy_bw / 1e9,
                     date=time.strftime("%Y-%m-%d", time.gmtime()))
        (args.out / "gemv_tuned.json").write_text(json.dumps(found, indent=1))
        print(f"\n{props.name}: copy bandwidth {copy_bw / 1e9:.0f} GB/s")
        print(f"{'file':10} {'N':>6} {'K':>6} {'mt':>2} {'variant':18} {'us':>8} {'of copy':>7}")
        for r in found["best"]:
            print(f"{r['file']:10} {r['n']:6d} {r['k']:6d} {r['mt']:2d} {r['variant']!s:18} "
                  f"{r['us']:8.1f} {r['of_copy']:7.1%}")
        gemv = Gemv(device, target, pdl=args.pdl,
                    tuned=args.out / "gemv_tuned.json")  # the table just measured
        gemv.compile()
    rows = []
    for path, kind in itertools.product(args.paths.split(","), args.kinds.split(",")):
        if path in ("bulk", "ring") and kind != "bf16" or path != "table" and kind == "torch":
            continue
        for m in [int(v) for v in args.ms.split(",")]:
            for name, (n, k) in SHAPES_8B.items():
                if name == "lm_head" and m != 1:
                    continue
                rows.append({**bench_shape(gemv, kind, name, n, k, m, gen, path), "path": path})
                print(json.dumps(rows[-1]), flush=True)
            rows.append({**bench_layers(gemv, kind, m, gen, path=path), "path": path})
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    result = {"device": props.name, "copy_gbps": copy_bw / 1e9, "rows": rows}
    (args.out / "gemv_bench.json").write_text(json.dumps(result, indent=1))
    print(f"\n{props.name}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"PDL {'on' if args.pdl else 'off'}")
    print(f"{'kernel':7} {'path':7} {'shape':10} {'M':>3} {'us':>9} {'GB/s':>7} {'of copy':>7}")
    for r in rows:
        print(f"{r['kernel']:7} {r['path']:7} {r['shape']:10} {r['m']:3d} {r['us']:9.1f} "
              f"{r['gbps']:7.0f} {r['gbps'] * 1e9 / copy_bw:7.1%}")


if __name__ == "__main__":
    main()
