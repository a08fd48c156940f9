"""A dense layer's o projection and MLP through three bulk gemv launches and through the fused
launch (kernels/bulk_mlp.cu), alone: LAYERS layers of distinct weights (more bytes than the L2
holds) replayed in a CUDA graph under PDL, at M = 1.

    python bench/mlp_bench.py [--hidden 4096] [--k-o 4096] [--inter 12288] [--layers 36]

Prints us per layer and the fraction of copy bandwidth (the weights' bytes over the time, against
a device-to-device copy measured in the same run); "fused, no barrier" skips the grid barriers
(its results are wrong: it prices them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from kestrel_rt.cuda.bulk_mlp import BulkMlp
from kestrel_rt.cuda.linear import Gemv
from kestrel_rt.cuda.timing import time_graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--k-o", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=12288)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    H, KO, I, L = args.hidden, args.k_o, args.inter, args.layers
    dev = torch.device("cuda")

    def w(n, k):
        return (torch.randn(n, k, device=dev) * 0.02).bfloat16()

    layers = [(w(H, KO), w(2 * I, H), w(H, I)) for _ in range(L)]
    nw = torch.ones(H, device=dev, dtype=torch.bfloat16)
    o = torch.randn(1, KO, device=dev).bfloat16()
    h0 = torch.randn(1, H, device=dev).bfloat16()
    g = Gemv(dev, pdl=True)
    fused, nobar = BulkMlp(g), BulkMlp(g, ("-DMLP_NO_BARRIER",))

    def three():
        h = h0
        for wo, wgu, wd in layers:
            h = g.bf16(o, wo, residual=h)
            act = g.bf16(h, wgu, norm=nw, eps=1e-6, glu=True)
            h = g.bf16(act, wd, residual=h)

    def run(mlp):
        def chain():
            h = h0
            for wo, wgu, wd in layers:
                h = mlp(o, h, wo, wgu, wd, nw, 1e-6)
        return chain

    copy = measure.copy_bandwidth()
    nbytes = L * 2 * (H * KO + 2 * I * H + H * I)
    print(f"{L} layers H={H} KO={KO} I={I}: {nbytes / 1e6:.0f} MB, copy {copy / 1e9:.0f} GB/s")
    for label, fn in (("three launches", three), ("fused", run(fused)),
                      ("fused, no barrier", run(nobar)), ("three launches", three),
                      ("fused", run(fused))):
        s = time_graph(fn, args.reps)
        print(f"{label:18s} {s / L * 1e6:8.1f} us per layer  {nbytes / s / copy * 100:5.1f}% "
              f"of copy", flush=True)


if __name__ == "__main__":
    main()
