"""Device time of GPU work with CUDA events: median of several runs, or of replays of a CUDA
graph (work whose eager launches cost the host more than the kernels take). Used by the
runtime's own choices (kestrel_rt/cuda/ring_probe.py) and by the benchmarks (bench/measure.py)."""

from __future__ import annotations

import statistics

import torch


def median_event_s(fn, reps: int) -> float:
    """Median seconds of fn() on the current stream, timed with CUDA events."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def time_graph(fn, reps: int = 10) -> float:
    """Median seconds of one replay of a graph that runs fn once (current device)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm up: compile, module load, cuBLAS handles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    return median_event_s(graph.replay, reps)
