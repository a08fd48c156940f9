"""Where a 512-token prefill goes: eager against a captured CUDA graph, and its kernels.

    python bench/probes/prefill_probe.py [--models qwen3-0.6b,qwen3-8b] [--tokens 512]

For each model (dummy bf16 weights, a KV cache of two slots of 2112 positions), times one
`Qwen3Model.compute` over `tokens` prompt tokens eagerly (GPU time between two events, and
the host's enqueue time) and as a replayed CUDA graph captured over a static Step, then
prints the eager call's torch profiler table. Prefill is host-bound when the eager
host time matches its GPU time and the graph's is far lower (docs/performance.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from kestrel_rt.runner import build_model


def timed(fn, reps: int = 10) -> tuple[float, float]:
    """Median (GPU ms, host enqueue ms) of `fn` over `reps` calls after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host = time.perf_counter() - t0
        end.synchronize()
        out.append((start.elapsed_time(end), host * 1e3))
    out.sort()
    return out[len(out) // 2]


def probe(name: str, n: int) -> None:
    model = build_model(name, "cuda")
    model.allocate_kv(2, 2048 + 64)
    slot = model.kv.allocate()
    tokens = torch.randint(0, 1000, (1, n), device="cuda")  # [1, n]

    def eager() -> None:
        model.kv.rollback(slot, 0)
        step = model.kv.step([slot], n, [n])
        model.compute(tokens, step, last_only=True, greedy=True)

    dev_ms, host_ms = timed(eager)
    step = model.kv.step([slot], n, [n], static=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model.compute(tokens, step, last_only=True, greedy=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.compute(tokens, step, last_only=True, greedy=True)
    graph_ms, _ = timed(graph.replay)
    print(f"{name} prefill {n}: eager device {dev_ms:.2f} ms (host enqueue {host_ms:.2f}), "
          f"graph {graph_ms:.2f} ms (static max_ctx)", flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        eager()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                    max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    if not 0 < args.tokens <= 2112:
        sys.exit(f"prefill_probe: --tokens {args.tokens}: expected 1..2112 (the cache's length)")
    if not torch.cuda.is_available():
        sys.exit("prefill_probe: needs a CUDA device")
    for name in args.models.split(","):
        probe(name, args.tokens)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
