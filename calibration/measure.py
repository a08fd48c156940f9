"""Timing one grid point on a built model: the runtime's own forwards, CUDA events on a GPU,
the host clock on the CPU.

    bench = Bench("target@gpu", model, slots=list(range(64)), warmup=2, repeats=7)
    record = measure(bench, point)          # Record: median ms, p10 / p90, samples

Every point runs `warmup` untimed times first (a CUDA graph captured, kernels compiled,
cuBLAS warmed: nothing compiles inside a timed run), then `repeats` timed times; the record is
their median. Before each run the sequences' KV lengths are set to the point's context by
bookkeeping alone (`KVCache.rollback` / `advance`: the content does not matter, the attention
reads that many cached keys), and the rows rotate over the bench's slots from run to run, so
consecutive runs read different cache memory where the bench has spare slots.

On a GPU, run n + 1 is enqueued before the host waits for run n (as the serving loop overlaps
its steps), and each run's time is its CUDA events' interval on the stream: device time plus
any gap the host leaves. A point whose last warm-up run took REST_FROM_MS or more (prefill
chunks, mixed steps, big verifies: seconds of full-power matmuls over its runs) is timed
with a rest instead: each run is waited for and followed by as long an idle, a half duty
cycle, as serving puts decode steps or idle time between chunks. Back to back, the H200
lowers its clock under such load: a 2048-token qwen3-8b prefill took 56.9 ms back to back
against 53.6 ms with 60 ms idle or ten decode steps between (bench/probes/clock_probe.py,
2026-12-02), which made the profile's prefill rows 4-15% slower than the served chunks.
What each stage runs:

- decode, verify, draft: `model.forward([b, M] tokens, greedy=True)` (a graph replay on a
  GraphModel for M <= 16 and b <= 64); a draft step of M > 1 as a round's first draft step
  (the catch-up, kestrel_rt/spec/round.py draft_argmax): `forward([b, M], n_new=[M] * b,
  last_only=True, greedy=True)`, its own graph (captured when the bench is built);
- correction: a verify of after_k + 1 tokens (untimed, enqueued first), then the timed
  one-token forward at the same context;
- prefill, draft_prefill: b chunks at the chunk's context, each its own
  `model.forward([1, C], last_only=True, greedy=True)` (a prefill-graph replay on a
  GraphModel), as serving prefills the chunks of a step on the target and then on the
  draft (kestrel_rt/serve/forward.py);
- mixed: `kestrel_rt.packed.forward_mixed` with the rows' group and the chunk's group (the
  rows' forward then the chunk's, as serving runs a mixed step);
- kv_transfer: `kestrel_rt.serve.handover.copy_rows` of n tokens between two caches of the
  model's geometry, on a stream of its own on a GPU (as the serving link copies): both on
  the model's device, or the second on the point's `peer` GPU (a peer copy, the link
  between GPUs); the record names the pair ("cuda:0->cuda:1").
- overlap: a decode worker's step and a prefill worker's chunk at once, on two instances of
  the target on two streams of one GPU (calibration/overlap.py);
- round: a whole speculative round of the target and the draft, by the host clock
  (calibration/rounds.py); a draft step of the bench spec@cpu, inside such rounds
  (calibration/draft_rounds.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from calibration.grid import Point
from kestrel_rt.kv_cache import KVCache
from kestrel_rt.model import Qwen3Model

REST_FROM_MS = 20.0  # a GPU point whose runs take this long is timed with rests (docstring)


@dataclass
class Record:
    """A measured point (kestrel_sim's Measurement once converted: calibration/record.py)."""

    point: Point
    ms: float  # median of the timed runs
    samples: int
    p10: float
    p90: float
    bytes: int | None = None  # kv_transfer: bytes copied
    link: str | None = None  # kv_transfer: "SRC->DST" devices of the copy


@dataclass
class Bench:
    """One built model instance, the KV slots it owns, and how many runs a point gets."""

    name: str  # "target@gpu", ...
    model: Qwen3Model
    slots: list[int]
    warmup: int
    repeats: int
    turn: int = 0  # rotation of the rows over the slots
    # kv_transfer: (sending, receiving) cache per destination ("": the model's device)
    transfers: dict[str, tuple[KVCache, KVCache]] = field(default_factory=dict, repr=False)

    @property
    def on_gpu(self) -> bool:
        return self.model.device.type == "cuda"

    def take(self, n: int) -> list[int]:
        """n distinct slots, a different window of the bench's slots each call."""
        pool = self.slots
        if n > len(pool):
            raise ValueError(f"{self.name}: a point needs {n} KV slots, the bench has "
                             f"{len(pool)}")
        start = (self.turn * n) % len(pool)
        self.turn += 1
        return [pool[(start + i) % len(pool)] for i in range(n)]

    def tokens(self, b: int, m: int) -> torch.Tensor:
        """Random token ids [b, m] on the model's device."""
        return torch.randint(0, self.model.shape.vocab_size, (b, m), device=self.model.device)


def set_lengths(kv: KVCache, slots: list[int], length: int) -> None:
    """Every slot holds `length` cached tokens (bookkeeping only)."""
    for s in slots:
        kv.rollback(s, 0)
    kv.advance(slots, [length] * len(slots))


def percentile(sorted_ms: list[float], q: float) -> float:
    """Linear-interpolated q-quantile (0..1) of sorted values."""
    pos = q * (len(sorted_ms) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


def timed(bench: Bench, point: Point, setup, run, nbytes: int | None = None,
          link: str | None = None) -> Record:
    """setup() -> state, untimed (host bookkeeping, device work to come before); run(state),
    timed; warmup + repeats times. Returns the record of the timed runs."""
    times: list[float] = []
    if bench.on_gpu:
        events, previous, rest = [], None, False
        for i in range(bench.warmup + bench.repeats):
            state = setup()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            run(state)
            end.record()
            if previous is not None:
                previous.synchronize()  # at most one run ahead of the device
            previous = end
            if i >= bench.warmup:
                events.append((start, end))
            if rest or i == bench.warmup - 1:
                end.synchronize()
                took = start.elapsed_time(end)  # ms
                rest = rest or took >= REST_FROM_MS
                if rest:  # idle as long as the run took: a half duty cycle (docstring)
                    time.sleep(took / 1e3)
                    previous = None
        torch.cuda.synchronize(bench.model.device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for i in range(bench.warmup + bench.repeats):
            state = setup()
            t0 = time.perf_counter()
            run(state)
            elapsed = (time.perf_counter() - t0) * 1e3
            if i >= bench.warmup:
                times.append(elapsed)
    return record_of(point, times, bytes=nbytes, link=link)


def record_of(point: Point, times: list[float], cls=Record, **extra) -> Record:
    """A `cls` record of a point's timed runs (ms): median, count, p10 and p90."""
    times = sorted(times)
    return cls(point, statistics.median(times), len(times), percentile(times, 0.1),
               percentile(times, 0.9), **extra)


def measure(bench: Bench, point: Point) -> Record:
    """Time one point on the bench's model; see the module docstring."""
    stage = point.stage
    if stage == "overlap":  # a PairBench's point: calibration/overlap.py
        from calibration.overlap import measure_overlap

        return measure_overlap(bench, point)
    if stage == "round":  # a SpecBench's point: calibration/rounds.py
        from calibration.rounds import measure_round

        return measure_round(bench, point)
    if point.model == "spec" and stage == "draft":  # timed inside rounds: draft_rounds.py
        from calibration.draft_rounds import measure_draft_in_rounds

        return measure_draft_in_rounds(bench, point)
    if stage == "kv_transfer":
        return measure_transfer(bench, point)
    if stage == "mixed":
        return measure_mixed(bench, point)
    model, kv = bench.model, bench.model.kv
    b, m, c = point.batch, point.m, point.context
    tokens = bench.tokens(b, m)  # [b, M]
    verify = bench.tokens(b, point.after_k + 1) if stage == "correction" else None  # [b, k+1]

    def setup() -> list[int]:
        slots = bench.take(b)
        set_lengths(kv, slots, c)
        if verify is not None:  # the verify the correction follows, untimed
            model.forward(verify, slots, greedy=True)
            set_lengths(kv, slots, c)
        return slots

    def run(slots: list[int]) -> None:
        if point.prompt_chunk:  # each prompt chunk its own forward, as serving prefills them
            for i, slot in enumerate(slots):
                model.forward(tokens[i:i + 1], [slot], last_only=True, greedy=True)
        elif point.catch_up:  # the choice after each row's last token only: [b]
            model.forward(tokens, slots, [m] * b, last_only=True, greedy=True)
        else:
            model.forward(tokens, slots, greedy=True)

    try:
        return timed(bench, point, setup, run)
    finally:
        set_lengths(kv, bench.slots, 0)


def measure_mixed(bench: Bench, point: Point) -> Record:
    """Decode / verify rows and one prompt chunk, as serving runs a mixed step."""
    from kestrel_rt.packed import Group, forward_mixed

    model, kv = bench.model, bench.model.kv
    b = point.batch
    rows = bench.tokens(b, point.m)  # [b, M]
    chunk = bench.tokens(1, point.chunk_tokens)  # [1, C]

    def setup() -> list[int]:
        slots = bench.take(b + 1)
        set_lengths(kv, slots[:b], point.context)
        set_lengths(kv, slots[b:], point.chunk_context)
        return slots

    def run(slots: list[int]) -> None:
        forward_mixed(model, Group(rows, slots[:b]), [Group(chunk, slots[b:], last_only=True)])

    try:
        return timed(bench, point, setup, run)
    finally:
        set_lengths(kv, bench.slots, 0)


def transfer_caches(model: Qwen3Model, tokens: int,
                    to: str | None = None) -> tuple[KVCache, KVCache]:
    """Two one-slot caches of the model's geometry (the sending and receiving instance's),
    the second on device `to` (default: the model's)."""
    s, be = model.shape, model.backend
    dims = (s.num_hidden_layers, 1, tokens, s.num_key_value_heads, s.head_dim)
    return (KVCache(*dims, model.device, be.dtype),
            KVCache(*dims, torch.device(to) if to else model.device, be.dtype))


def transfer_bytes(model: Qwen3Model, tokens: int) -> int:
    """Bytes of K and V that n tokens hold in the model's cache (all layers)."""
    return tokens * model.shape.kv_elements_per_token * model.backend.dtype.itemsize


def measure_transfer(bench: Bench, point: Point) -> Record:
    """The serving hand-over's copy of n tokens' KV rows between two caches (on two GPUs for
    a point with a peer)."""
    from kestrel_rt.serve.handover import copy_rows

    n, to = point.m, point.peer
    pair = bench.transfers.get(to)
    if pair is None or pair[0].max_len < n:
        bench.transfers.pop(to, None)  # free the smaller pair first
        bench.transfers[to] = transfer_caches(bench.model, n, to or None)
    src, dst = bench.transfers[to]

    def setup() -> None:
        dst.rollback(0, 0)

    def run(_: None) -> None:
        copy_rows(src, 0, dst, 0, n)

    nbytes = transfer_bytes(bench.model, n)
    link = f"{src.k.device}->{dst.k.device}"
    if not bench.on_gpu:
        return timed(bench, point, setup, run, nbytes, link)
    stream = torch.cuda.Stream(bench.model.device)
    stream.wait_stream(torch.cuda.current_stream(bench.model.device))
    with torch.cuda.stream(stream):  # the events and copies on the link's stream
        return timed(bench, point, setup, run, nbytes, link)
