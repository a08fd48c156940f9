"""Where a batch-1 decode attention launch spends its time: per-phase clocks from inside the
kernel (H200 diagnosis).

    python bench/probes/attention_probe.py [--ctx 128] [--models qwen3-8b,qwen3-30b-a3b]

Compiles kernels/decode_attention.cu with -DDECODE_PROBE (a diagnostic build: thread 0 of each
block that holds keys appends a record of clock64 marks, see the kernel's header) and replays
36 layers of rope_attention (the model's heads, M = 1, bf16, `ctx` cached tokens) in one CUDA
graph, in three settings: "hot" (the layers back to back, the KV cache in L2), "cold" (a
96 MB copy before each layer evicts L2, as the decode step's weight stream does) and "pdl"
(hot, each launch programmatic-dependent on the one before). Prints, per setting, the
graph's time per layer and the median over blocks and layers of each phase in microseconds:
the PDL wait, the RoPE prologue, the key loop, storing the partials, the arrival ticket, the
merge (merging blocks only), and the span from the first block's start to the last block's
end (with PDL, launches overlap and the span is approximate).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ (measure)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

import measure

from kestrel_rt.cuda import attention
from kestrel_rt.cuda.module import KernelModules
from kestrel_rt.kv_cache import KVCache
from kestrel_sim.models import preset

LAYERS, MAX_LEN = 36, 4096
WORDS, MARKS = 12, 6  # int64 per record (PROBE_WORDS), clock marks per record (PROBE_MARKS)
NS, CYCLES = 4 + MARKS, 5 + MARKS  # a record's ns and cycles since its start, at its save
PHASES = ("wait", "rope", "keys", "partials", "ticket", "merge")


def records(km: KernelModules):
    """(probe_n as a cupy uint32 array of 1, probe_rec as a cupy int64 [records, WORDS])."""
    import cupy

    mod = km.module("decode_attention")
    n = cupy.ndarray((1,), cupy.uint32, mod.get_global("probe_n"))
    rec = cupy.ndarray((65536, WORDS), cupy.int64, mod.get_global("probe_rec"))
    return n, rec


def phases(rec, per_launch: int) -> dict[str, float]:
    """Median microseconds of each phase over the records (rows of WORDS ints), and of each
    launch's span (first block start to last block end; launches do not overlap without PDL,
    so consecutive groups of per_launch records are one launch each)."""
    rows = [list(map(int, r)) for r in rec]
    # SM clock (cycles per ns): each record's cycles over its globaltimer ns at its save
    ratios = [r[CYCLES] / r[NS] for r in rows if r[NS] > 0 and r[CYCLES] > 0]
    rate = statistics.median(ratios) if ratios else 1.98
    out: dict[str, float] = {}
    for i, name in enumerate(PHASES):
        vals = []
        for r in rows:
            m = r[4:4 + MARKS]
            if m[i] < 0 or (i > 0 and m[i - 1] < 0):
                continue
            vals.append((m[i] - (m[i - 1] if i else 0)) / rate / 1e3)
        out[name] = statistics.median(vals) if vals else float("nan")
    spans = []
    for s in range(0, len(rows) - per_launch + 1, per_launch):
        g = rows[s:s + per_launch]
        spans.append((max(r[3] + r[NS] for r in g) - min(r[3] for r in g)) / 1e3)
    out["span"] = statistics.median(spans) if spans else float("nan")
    out["GHz"] = rate
    return out


def case(km_plain, km_pdl, shape, ctx: int, mode: str) -> dict[str, float]:
    dt, D = torch.bfloat16, shape.head_dim
    Hq, Hkv = shape.num_attention_heads, shape.num_key_value_heads
    km = km_pdl if mode == "pdl" else km_plain
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv = KVCache(LAYERS, 1, MAX_LEN, Hkv, D, torch.device("cuda"), dt)
    kv.k.normal_()
    kv.v.normal_()
    kv.lengths[0] = ctx
    step = kv.step([0], 1, [1])
    qkv = torch.randn(1, 1, (Hq + 2 * Hkv) * D, device="cuda", dtype=dt)
    q = qkv[..., : Hq * D].view(1, 1, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
    v = qkv[..., (Hq + Hkv) * D:].unflatten(-1, (Hkv, D))
    norm = torch.ones(D, device="cuda", dtype=dt)
    cos = torch.randn(MAX_LEN, D, device="cuda", dtype=dt)
    sin = torch.randn(MAX_LEN, D, device="cuda", dtype=dt)
    flush_a = torch.empty(48 << 20, device="cuda", dtype=torch.bfloat16)
    flush_b = torch.empty_like(flush_a)
    out = torch.empty_like(q)

    def run():
        for i in range(LAYERS):
            if mode == "cold":
                flush_b.copy_(flush_a)
            attention.rope_attention(km, q, k, v, norm, norm, cos, sin, kv.k[i], kv.v[i],
                                     step.slots, step.positions, 1e-6, sms, out=out)

    n, rec = records(km)
    layer_s = measure.time_graph(run, 20)
    n[0] = 0
    run()  # eagerly once more: one group of records per layer
    torch.cuda.synchronize()
    got = int(n[0])
    chunk = max(-(-(ctx + 1) // attention.decode_splits(1, Hkv, MAX_LEN, sms)),
                attention.DECODE_MIN_KEYS, 2 * attention.DECODE_WARPS)
    per_launch = Hkv * -(-(ctx + 1) // chunk)
    res = phases(rec[:got].get(), per_launch)
    flush_us = 0.0
    if mode == "cold":
        flush_us = measure.time_graph(lambda: flush_b.copy_(flush_a), 20) * 1e6
    res["layer"] = layer_s / LAYERS * 1e6 - flush_us
    res["records"] = got
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--models", default="qwen3-8b,qwen3-30b-a3b")
    args = ap.parse_args()
    dev = torch.device("cuda")
    km_plain = KernelModules(dev, defines=("DECODE_PROBE",))
    km_pdl = KernelModules(dev, pdl=True, defines=("DECODE_PROBE",))
    cols = ("layer", "span") + PHASES
    print(f"decode attention phases, batch 1, {args.ctx} cached tokens, bf16, "
          f"median us over blocks and {LAYERS} layers (diagnostic build)\n")
    print("| model | mode | " + " | ".join(cols) + " | GHz |")
    print("| --- | --- | " + " | ".join("---:" for _ in cols) + " | ---: |")
    for name in args.models.split(","):
        shape = preset(name)
        for mode in ("hot", "cold", "pdl"):
            r = case(km_plain, km_pdl, shape, args.ctx, mode)
            print(f"| {name} | {mode} | " + " | ".join(f"{r[c]:.2f}" for c in cols)
                  + f" | {r['GHz']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
