"""Is the draft's prefill slower right after the target's, as serving runs them, than timed
alone, as calibration times it?

    python bench/probes/draft_prefill_probe.py [--target qwen3-8b] [--draft qwen3-0.6b]
                                               [--chunks 512,2048] [--reps 15] [--out DIR]

Why: served speculative runs' `draft_prefill` spans (the draft prefilling a chunk right after
the target did, in one step: kestrel_rt/serve/forward.py run_step) ran 2-5% slower than the
profile's rows at 512 tokens and 7-15% at 2048. Calibration times each draft_prefill point
alone, back to back (calibration/measure.py `timed`). After the target's long compute-bound
prefill, the GPU's clock or power state may slow the draft's pass, or the host may be late.

Each chunk (context 0) on dummy-weight models built and prepared as calibration builds them
(prefill graphs captured), `reps` timed runs after two warm-ups, CUDA events on a GPU:
- (a) the draft alone, back to back: calibration's own `measure` of the point;
- (b) the draft alone, the host idle `--gap-ms` before each run;
- (c) the draft right after the target's prefill of the same chunk, both through serving's
  `prefill_forward` (host token ids, as serving passes them), an event between the two;
- (d) the target's part of (c), to compare with the profile's prefill row;
- (e) as (c), both called as calibration calls them (device token ids): (c) less (e) is
  serving's host path.
The host idles `--gap-ms` between the pairs of (c) and (e), as calibration rests after a long
run. After each configuration, nvidia-smi's SM clock (clock_probe.py). It prints a table and,
with --out, writes draft_prefill_probe.json there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))  # clock_probe

from clock_probe import gpu_state

from calibration.measure import Bench, measure, percentile, set_lengths
from calibration.points import Point
from kestrel_rt.runner import build_model, prepare
from kestrel_rt.serve.forward import prefill_forward

WARMUP = 2


def built(name: str, device: str, chunks: list[int], reps: int) -> Bench:
    """The preset's model with two KV slots (calibration's rotation), prefill graphs of each
    chunk captured (calibration/driver.py build_bench)."""
    model = build_model(name, device, seed=0)
    buckets = tuple(getattr(model, "prefill_buckets", ()))
    max_len = max(next((n for n in buckets if n >= c), c) for c in chunks) + 1
    prepare(model, 2, max_len, prefill=tuple(chunks))
    return Bench(f"{name}@{device}", model, [model.kv.allocate() for _ in range(2)], WARMUP,
                 reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--draft", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--chunks", default="512,2048")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--gap-ms", type=float, default=60.0)
    ap.add_argument("--out", default=None, help="folder for draft_prefill_probe.json")
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    gpu = args.device.startswith("cuda")
    target = built(args.target, args.device, chunks, args.reps)
    draft = built(args.draft, args.device, chunks, args.reps)
    vocab = min(target.model.shape.vocab_size, draft.model.shape.vocab_size)

    def mark():  # a CUDA event recorded now, or the host clock (ms) on the CPU
        if not gpu:
            return time.perf_counter() * 1e3
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(start, end) -> float:
        return start.elapsed_time(end) if gpu else end - start

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def idle() -> None:
        time.sleep(args.gap_ms / 1e3)

    def runs(ids, run) -> list[list[float]]:
        """`reps` timed runs after WARMUP, each from idle (`gap-ms`): the ms between the marks
        run(ids, mark) returns, a list per interval."""
        times = []
        for i in range(WARMUP + args.reps):
            sync()
            idle()
            marks = run(ids, mark)
            sync()
            if i >= WARMUP:
                times.append([ms(a, b) for a, b in itertools.pairwise(marks)])
        return [list(t) for t in zip(*times)]

    rows = []

    def add(chunk: int, name: str, times: list[float]) -> None:
        t = sorted(times)
        rows.append((chunk, name, statistics.median(t), percentile(t, 0.1), percentile(t, 0.9),
                     gpu_state() if gpu else "-"))  # median ms, p10, p90, GPU state after

    def fresh(bench: Bench) -> list[int]:  # a slot of the bench's rotation, emptied
        slot = bench.take(1)
        set_lengths(bench.model.kv, slot, 0)
        return slot

    def draft_only(ids, mark):  # ids: [1, n] on the device
        start = mark()
        draft.model.forward(ids, fresh(draft), last_only=True, greedy=True)
        return [start, mark()]

    def as_serving(ids, mark):  # serving's step: the chunk on the target, then on the draft
        n, slots = ids.shape[1], (fresh(target), fresh(draft))
        jobs = [(SimpleNamespace(seq=SimpleNamespace(tokens=ids[0].tolist(), slot=s[0]), done=0),
                 n) for s in slots]  # prefill_forward's (job, tokens) chunks
        start = mark()
        prefill_forward(target.model, jobs[:1])
        between = mark()
        prefill_forward(draft.model, jobs[1:])
        return [start, between, mark()]

    def as_calibration(ids, mark):  # the same, each forward as calibration's measure calls it
        slots = fresh(target), fresh(draft)
        start = mark()
        target.model.forward(ids, slots[0], last_only=True, greedy=True)
        between = mark()
        draft.model.forward(ids, slots[1], last_only=True, greedy=True)
        return [start, between, mark()]

    for n in chunks:
        ids = torch.randint(0, vocab, (1, n), device=args.device)  # [1, n]
        idle()
        record = measure(draft, Point("draft", "gpu" if gpu else "cpu", "draft_prefill", 1, n))
        rows.append((n, "(a) draft alone, back to back (calibration)", record.ms, record.p10,
                     record.p90, gpu_state() if gpu else "-"))
        add(n, f"(b) draft alone, {args.gap_ms:g} ms idle before", runs(ids, draft_only)[0])
        target_ms, draft_ms = runs(ids, as_serving)
        add(n, "(c) draft after target (serving)", draft_ms)
        add(n, "(d) target before it (serving)", target_ms)
        add(n, "(e) draft after target (device ids)", runs(ids, as_calibration)[1])

    base = {n: med for n, name, med, *_ in rows if name.startswith("(a)")}
    title = (f"{args.target} then {args.draft}, prefill chunks at context 0, {args.reps} timed "
             f"each ({torch.cuda.get_device_name() if gpu else args.device})")
    print(f"\n{title}\n")
    print("| chunk | configuration | median ms | p10 | p90 | vs (a) | GPU after |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- |")
    table = []
    for n, name, med, p10, p90, clock in rows:
        vs = "" if name.startswith("(d)") else f"{100 * (med / base[n] - 1):+.1f}%"
        print(f"| {n} | {name} | {med:.3f} | {p10:.3f} | {p90:.3f} | {vs} | {clock} |")
        table.append({"chunk": n, "configuration": name, "median_ms": med, "p10_ms": p10,
                      "p90_ms": p90, "gpu_after": clock})
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "draft_prefill_probe.json").write_text(
            json.dumps({"title": title, "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
