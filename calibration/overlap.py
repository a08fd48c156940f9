"""Timing the overlap points: a step of each disaggregated worker at once on one GPU.

    pair = build_pair(bench_plan, grid)        # two instances of the target, two streams
    record = measure_overlap(pair, point)      # OverlapRecord: ms beside, alone_ms alone

The runtime's disaggregated mode on one GPU runs the prefill worker and the decode worker
on two CUDA streams, each with its own model instance and KV cache, and their kernels
contend for bandwidth and SMs. A pair bench is the same: two instances of the target
(`decode`: decode or verify rows, `prefill`: one prompt chunk per forward, as the
serving forwards run them, graph replays where graphable), each on a stream of its own.
With draft points (overlap_grid.py `draft_batches`) a third instance, the draft, as the
speculative decode worker holds it beside its target: its one-token steps run on the
decode stream in place of the target's rows, beside the prefill instance's chunk.

An overlap point times one side's step (`point.timed`) while the other side's step loops
on the other stream:

  1. the timed step alone on its stream, warm-up + timed runs (calibration.measure.timed):
     `alone_ms`, the median;
  2. the other step alone, a few runs: its time, to size the loop;
  3. warm-up + timed runs of: the other step's first forward on its stream (an event
     after it), the timed step on its own stream waiting on that event (so the other
     stream is busy when it starts), then the other step's remaining forwards, at least
     COVER x the timed step alone in all (overlap_grid.COVER). The timed step's CUDA
     events on its stream give its time beside the other; an event after the loop checks
     that the loop outlasted it (else the run is made again with a loop twice as long).

The host enqueues everything of a run before the device has finished the other's first
forward (graph replays: tens of microseconds each), and waits for the device between runs.
Each forward's cache lengths are set by bookkeeping alone (calibration.measure.set_lengths)
so the loop's chunk stays at its context however many times it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from calibration.driver import ROTATION
from calibration.measure import Bench, Record, record_of, set_lengths, timed
from calibration.overlap_grid import COVER

ALONE_RUNS = 3  # timed runs of the other step alone, to size the loop
TRIES = 3  # runs made again with a loop twice as long before a point fails


@dataclass
class OverlapRecord(Record):
    alone_ms: float = 0.0  # the timed step alone, median of the same number of runs


@dataclass
class Side:
    """One worker's part of a point: its bench, stream, and its step (setup, run)."""

    bench: Bench
    stream: torch.cuda.Stream
    setup: object  # () -> state (host bookkeeping)
    run: object  # (state) -> None: enqueue the step on the current stream


@dataclass
class PairBench:
    """Two instances of the target on one GPU, each with its stream (and the draft's)."""

    name: str
    decode: Bench  # the decode worker's instance: decode / verify rows
    prefill: Bench  # the prefill worker's instance: one prompt chunk per forward
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream]  # (decode, prefill)
    draft: Bench | None = None  # the decode worker's draft: one-token draft steps

    def stepper(self, point) -> Bench:
        """The instance that runs a point's decode-side step."""
        return self.draft if point.decode_model == "draft" else self.decode


def loop_length(alone_ms: float, other_ms: float) -> int:
    """Forwards of the other step: one before the timed step starts, then enough to last
    COVER x the timed step's time alone."""
    return 1 + max(1, math.ceil(COVER * alone_ms / max(other_ms, 1e-6)))


def layout(points, side: str, prefill_buckets: tuple[int, ...]) -> dict:
    """prepare()'s arguments for one instance of the pair: slots, max_len, batches, new
    tokens and prefill lengths covering every point's step of that side."""
    if side == "decode":
        return {"slots": ROTATION * max(p.batch for p in points),
                "max_len": max(p.context + p.m for p in points) + 1,
                "batches": tuple(sorted({p.batch for p in points})),
                "new_tokens": tuple(sorted({p.m for p in points})), "prefill": (32,)}

    def padded(n: int) -> int:
        return next((b for b in prefill_buckets if b >= n), n)

    return {"slots": ROTATION, "batches": (1,), "new_tokens": (1,),
            "max_len": max(p.chunk_context + padded(p.chunk_tokens) for p in points) + 1,
            "prefill": tuple(sorted({p.chunk_tokens for p in points}))}


def instances(bp) -> list[tuple[str, object, list]]:
    """(role, BenchPlan to build, points laid out on it) of each instance of the bench:
    the decode and prefill instances of the target, and the draft where points need it."""
    drafted = [p for p in bp.points if p.decode_model == "draft"]
    target = [p for p in bp.points if p.decode_model != "draft"] or bp.points
    out = [("decode", bp, target), ("prefill", bp, bp.points)]
    if drafted and bp.draft is not None:
        out.append(("draft", bp.draft, drafted))
    return out


def build_pair(bp, grid) -> PairBench:
    """The pair bench of a plan's `pair@gpu` BenchPlan: every instance built and prepared
    (the draft with the draft's BenchPlan, `bp.draft`, where points need it)."""
    from calibration.driver import bench_options
    from kestrel_rt.runner import build_model, prepare

    t = grid.timing
    benches = {}
    for role, plan, points in instances(bp):
        model = build_model(plan.model, plan.device, plan.dtype, plan.quant,
                            bench_options(plan), seed=0)
        side = "prefill" if role == "prefill" else "decode"
        lay = layout(points, side, tuple(getattr(model, "prefill_buckets", ())))
        prepare(model, lay["slots"], lay["max_len"], lay["batches"], lay["new_tokens"],
                prefill=tuple(n for n in lay["prefill"] if n < lay["max_len"]) or (16,))
        slots = [model.kv.allocate() for _ in range(lay["slots"])]
        benches[role] = Bench(f"{bp.name}/{role}", model, slots, t.warmup, t.repeats)
    device = benches["decode"].model.device
    torch.cuda.synchronize(device)
    return PairBench(bp.name, benches["decode"], benches["prefill"],
                     (torch.cuda.Stream(device), torch.cuda.Stream(device)),
                     benches.get("draft"))


def sides(pair: PairBench, point) -> tuple[Side, Side]:
    """(decode side, prefill side) of a point (the decode side's step: the target's rows,
    or the draft's one-token step)."""
    dec, pre = pair.stepper(point), pair.prefill
    if dec is None:
        raise RuntimeError(f"{point.id}: the pair bench has no draft instance (--draft)")
    b, c = point.batch, point.context
    rows = dec.tokens(b, point.m)  # [b, M]
    chunk = pre.tokens(1, point.chunk_tokens)  # [1, C]

    def decode_setup() -> list[int]:
        slots = dec.take(b)
        set_lengths(dec.model.kv, slots, c)
        return slots

    def prefill_setup() -> list[int]:
        slots = pre.take(1)
        set_lengths(pre.model.kv, slots, point.chunk_context)
        return slots

    return (Side(dec, pair.streams[0], decode_setup,
                 lambda slots: dec.model.forward(rows, slots, greedy=True)),
            Side(pre, pair.streams[1], prefill_setup,
                 lambda slots: pre.model.forward(chunk, slots, last_only=True, greedy=True)))


def alone(side: Side, point, runs: tuple[int, int] | None = None) -> Record:
    """The side's step alone on its stream (warm-up, timed runs: the bench's, or `runs`)."""
    bench = side.bench if runs is None else replace(side.bench, warmup=runs[0],
                                                    repeats=runs[1])
    with torch.cuda.stream(side.stream):
        return timed(bench, point, side.setup, side.run)


def beside(mine: Side, other: Side, reps: int) -> tuple[float, bool]:
    """One run: `mine` timed while `other` loops `reps` forwards on its stream; (ms,
    whether the loop outlasted the timed step)."""
    device = mine.bench.model.device
    first = torch.cuda.Event()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    loop_end = torch.cuda.Event(enable_timing=True)
    state = mine.setup()
    with torch.cuda.stream(other.stream):
        other.run(other.setup())
        first.record()
    with torch.cuda.stream(mine.stream):
        mine.stream.wait_event(first)
        start.record()
        mine.run(state)
        end.record()
    with torch.cuda.stream(other.stream):
        for _ in range(reps - 1):
            other.run(other.setup())
        loop_end.record()
    torch.cuda.synchronize(device)
    ms = start.elapsed_time(end)
    return ms, start.elapsed_time(loop_end) >= ms


def measure_overlap(pair: PairBench, point) -> OverlapRecord:
    """Time one overlap point; see the module docstring."""
    decode, prefill = sides(pair, point)
    made_on = torch.cuda.current_stream(pair.decode.model.device)
    stepper = pair.stepper(point)
    for stream in pair.streams:
        stream.wait_stream(made_on)  # the token ids sides() made
    mine, other = (decode, prefill) if point.timed == "decode" else (prefill, decode)
    try:
        solo = alone(mine, point)
        reps = loop_length(solo.ms, alone(other, point, (1, ALONE_RUNS)).ms)
        bench = mine.bench
        times = []
        for i in range(bench.warmup + bench.repeats):
            for _ in range(TRIES):
                ms, covered = beside(mine, other, reps)
                if covered:
                    break
                reps *= 2
            else:
                raise RuntimeError(f"{point.id}: the other step's loop of {reps // 2} "
                                   "forwards did not outlast the timed step")
            if i >= bench.warmup:
                times.append(ms)
    finally:
        set_lengths(stepper.model.kv, stepper.slots, 0)
        set_lengths(pair.prefill.model.kv, pair.prefill.slots, 0)
    return record_of(point, times, OverlapRecord, alone_ms=solo.ms)
