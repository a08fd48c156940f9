"""Decode attention time against the blocks per SM its context splits aim at (H200 tuning).

    python bench/attention_splits.py [--per-sm 2,4,8,16]

36 layers of attention.attention (qwen3-8b heads unless noted, M = 1, bf16) captured in one
CUDA graph, for batch / context cases; prints microseconds per layer (median replay) for each
setting of
kestrel_rt.cuda.attention.DECODE_BLOCKS_PER_SM and the KV bytes' time at 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from kestrel_rt.cuda import attention
from kestrel_rt.cuda.module import KernelModules
from kestrel_rt.kv_cache import KVCache

LAYERS, D, MAX_LEN = 36, 128, 4096
CASES = [(1, 32, 8, 512), (1, 32, 8, 4000), (1, 16, 8, 4000), (8, 32, 8, 1000), (4, 32, 8, 4000)]


def layer_us(km, sms: int, B: int, Hq: int, Hkv: int, ctx: int) -> float:
    """Microseconds per layer of one graph replay of LAYERS attention calls."""
    dt = torch.bfloat16
    kv = KVCache(LAYERS, B, MAX_LEN, Hkv, D, torch.device("cuda"), dt)
    kv.k.normal_()
    kv.v.normal_()
    for s in range(B):
        kv.lengths[s] = ctx
    step = kv.step(list(range(B)), 1, [1] * B)
    qkv = torch.randn(B, 1, (Hq + 2 * Hkv) * D, device="cuda", dtype=dt)
    q = qkv[..., : Hq * D].view(B, 1, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
    v = qkv[..., (Hq + Hkv) * D:].unflatten(-1, (Hkv, D))

    def run():
        for i in range(LAYERS):
            attention.attention(km, q, k, v, kv.k[i], kv.v[i], step.slots, step.positions, sms)

    return measure.time_graph(run, 30) / LAYERS * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-sm", default="2,4,8,16")
    args = ap.parse_args()
    settings = [int(v) for v in args.per_sm.split(",")]
    km = KernelModules(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = attention.DECODE_BLOCKS_PER_SM
    print("| batch | Hq/Hkv | context | KV at 4.3 TB/s | " + " | ".join(
        f"{s}/SM us" for s in settings) + " |")
    print("| ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in settings) + " |")
    for B, Hq, Hkv, ctx in CASES:
        times = []
        for per_sm in settings:
            attention.DECODE_BLOCKS_PER_SM = per_sm
            times.append(layer_us(km, sms, B, Hq, Hkv, ctx))
        attention.DECODE_BLOCKS_PER_SM = default
        kv_us = B * ctx * Hkv * D * 2 * 2 / 4.3e12 * 1e6
        print(f"| {B} | {Hq}/{Hkv} | {ctx} | {kv_us:.2f} us | "
              + " | ".join(f"{t:.2f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
