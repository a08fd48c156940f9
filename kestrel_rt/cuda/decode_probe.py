"""Quick decode-speed probe of the cupy backend, eager vs CUDA graphs (dummy weights).

    python -m kestrel_rt.cuda.decode_probe qwen3-0.6b qwen3-8b --steps 64

Batch 1, a 32-token prompt, greedy decode; prints one line per (model, mode) with tok/s and
the bandwidth limit (weight bytes per step over --bandwidth, default the 4.2 TB/s copy rate
measured on the H200). Not the benchmark (that one covers quantization, batch sweeps and
prefill); this checks that graph capture of a real-sized model works and what it buys.

Measured 2026-11-30 on one H200 (torch 2.11, cupy 14.2; linear = cuBLAS), --steps 48:

    qwen3-0.6b  eager 125.5  graph 663.0 tok/s   (limit 3523)
    qwen3-8b    eager  74.8  graph 192.0 tok/s   (limit  277.5: 69%)
    qwen3-30b-a3b eager 51.6 graph 241.4 tok/s   (limit  690.4: 35%)
"""

from __future__ import annotations

import argparse
import time

import torch

from kestrel_rt.backend.cupy_backend import CupyBackend
from kestrel_rt.cuda.graphs import GraphModel
from kestrel_rt.model import Qwen3Model
from kestrel_rt.weights import load_dummy, weight_bytes


def step_bytes(shape) -> int:
    """Bytes of weights one batch-1 decode step reads (active experts only for MoE)."""
    total = weight_bytes(shape, torch.bfloat16)
    if shape.is_moe:
        per_expert = 3 * shape.hidden_size * shape.moe_intermediate_size * 2
        layers = sum(shape.is_moe_layer(i) for i in range(shape.num_hidden_layers))
        total -= layers * (shape.num_experts - shape.num_experts_per_tok) * per_expert
    total -= shape.vocab_size * shape.hidden_size * 2  # embedding: one row read
    if shape.tie_word_embeddings:
        total += shape.vocab_size * shape.hidden_size * 2  # ... but lm_head reads it all
    return total


def decode_tok_s(model: Qwen3Model, steps: int) -> float:
    slot = model.kv.allocate()
    logits = model.prefill([list(range(1, 33))], [slot])
    tok = logits.argmax(-1)[:, None]
    for _ in range(3):  # warm-up (and capture)
        tok = model.forward(tok, [slot], greedy=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model.forward(tok, [slot], greedy=True)
        int(tok[0, 0])  # the host needs the token, as a real decode loop does
    dt = time.perf_counter() - t0
    model.kv.free(slot)
    return steps / dt


def kernel_table(model: Qwen3Model, steps: int = 8, rows: int = 14) -> str:
    """Device time per kernel name over `steps` decode forwards (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    slot = model.kv.allocate()
    tok = model.prefill([list(range(1, 33))], [slot]).argmax(-1)[:, None]
    for _ in range(3):
        tok = model.forward(tok, [slot], greedy=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tok = model.forward(tok, [slot], greedy=True)
        torch.cuda.synchronize()
    model.kv.free(slot)
    stats = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            stats.append((t / steps, e.count // steps, e.key[:60]))
    stats.sort(reverse=True)
    total = sum(t for t, _, _ in stats)
    lines = [f"  device time per step {total / 1e3:.3f} ms"]
    lines += [f"  {t / 1e3:8.3f} ms {n:5d}x  {k}" for t, n, k in stats[:rows]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--bandwidth", type=float, default=4.2e12)
    ap.add_argument("--profile", action="store_true", help="per-kernel device time (graph)")
    ap.add_argument("--max-len", type=int, default=2048, help="KV cache length (context)")
    args = ap.parse_args()
    for name in args.models:
        for mode, cls in (("eager", Qwen3Model), ("graph", GraphModel)):
            shape, weights = load_dummy(name, "cuda", torch.bfloat16)
            model = cls(shape, weights, CupyBackend("cuda", torch.bfloat16))
            model.allocate_kv(1, max(args.max_len, 32 + 2 * args.steps + 32))
            rate = decode_tok_s(model, args.steps)
            limit = args.bandwidth / step_bytes(shape)
            print(f"{name:14s} {mode:5s} {rate:8.1f} tok/s  limit {limit:7.1f}  "
                  f"{100 * rate / limit:5.1f}%", flush=True)
            if args.profile and mode == "graph":
                print(kernel_table(model), flush=True)
            del model, weights
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
