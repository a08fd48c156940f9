"""Does a step take longer when timed back to back, as calibration times it, than in
serving's rhythm? A 2048-token prefill of qwen3-8b, three ways.

    python bench/probes/clock_probe.py [--model qwen3-8b] [--tokens 2048] [--reps 9]

Why: served prefill chunks of 2048 tokens ran 4-15% faster than the profile's rows
(docs/validation.md, the stage audits of ladder-1/2/3/4 and disaggregated-saturated). The
calibration times a point's repeats back to back (calibration/measure.py `timed`), several
seconds of full-power GEMMs, where serving puts decode steps or idle time between chunks. If
the GPU lowers its clock under the sustained load, the profile's rows are slow.

Patterns, each `reps` prefills after two warm-ups (GPU time between CUDA events):
- back to back: as calibration runs them;
- with idle gaps: the host sleeps `--gap-ms` after each (the device idles);
- interleaved: ten batch-8 decode steps between prefills (serving's mixed rhythm).
Before and after each, nvidia-smi's SM clock, power and temperature. It prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from kestrel_rt.runner import build_model


def gpu_state() -> str:
    """nvidia-smi's SM clock (MHz), power (W) and temperature (C), or '-'."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return "-"
    if not out:
        return "-"
    clock, power, temp = (x.strip() for x in out[0].split(","))
    return f"{clock} MHz {float(power):.0f} W {temp} C"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--gap-ms", type=float, default=60.0)
    args = ap.parse_args()
    n = args.tokens
    model = build_model(args.model, "cuda")
    model.allocate_kv(9, n + 64)
    slot = model.kv.allocate()
    decode_slots = [model.kv.allocate() for _ in range(8)]
    prompt = torch.randint(0, 1000, (1, n))  # [1, n]
    step_in = torch.randint(0, 1000, (8, 1))  # [8, 1]

    def prefill() -> None:
        model.kv.rollback(slot, 0)
        model.forward(prompt, [slot], last_only=True, greedy=True)

    def decode() -> None:  # batch 8 at 1024 cached tokens (bookkeeping, as calibration)
        for s in decode_slots:
            model.kv.rollback(s, 0)
        model.kv.advance(decode_slots, [min(1024, n)] * len(decode_slots))
        model.forward(step_in, decode_slots, greedy=True)

    def run(between) -> list[float]:
        times = []
        for i in range(args.reps + 2):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            prefill()
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
            between()
        torch.cuda.synchronize()
        return times

    def idle() -> None:
        time.sleep(args.gap_ms / 1e3)

    def decodes() -> None:
        for _ in range(10):
            decode()
        torch.cuda.synchronize()

    patterns = [("back to back", lambda: None), (f"idle {args.gap_ms:g} ms between", idle),
                ("10 decode steps between", decodes)]
    rows = []
    for name, between in patterns:
        idle()
        before = gpu_state()
        times = run(between)
        rows.append((name, statistics.median(times), min(times), max(times), before,
                     gpu_state()))
    print(f"\n{args.model}, prefill of {n} tokens, {args.reps} timed each "
          f"({torch.cuda.get_device_name()})\n")
    print("| pattern | median ms | min | max | GPU before | GPU after |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for name, med, lo, hi, before, after in rows:
        print(f"| {name} | {med:.2f} | {lo:.2f} | {hi:.2f} | {before} | {after} |")


if __name__ == "__main__":
    main()
