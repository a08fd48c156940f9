"""What a decode step's host-device copies add to the overlapped loop's wall time.

    python bench/step_io_probe.py [--models qwen3-0.6b,qwen3-8b] [--steps 400]

For a GraphModel (dummy weights, bf16, batch 1, 128 cached tokens, greedy=True graphs) the
wall time per step of: the loop as bench/measure.py time_steps runs it (metadata copied in,
replay whose argmax kernel also writes the ids to pinned host memory, ids read one step
late); the same with the ids copied back by a device-to-host copy on the stream instead;
the loop without reading the ids; the captured graph replayed alone; replay + a copy back;
replay + the metadata copy. Each is timed over --steps steps after a warm-up, on the same
captured graph. A diagnostic: it decomposes the gap between the loop's rate and the graph's
device time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from h200_decode import build

from kestrel_rt.model import Chosen

CONTEXT = 128


@torch.inference_mode()
def probe(name: str, steps: int) -> list[tuple[str, float]]:
    model = build(name, "bf16")
    model.allocate_kv(1, 2048)
    kv = model.kv
    slot = kv.allocate()
    kv.advance([slot], [CONTEXT])
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")

    def forward(t, read: str = "host"):
        """ids [1, 1] on the device (+ to the host: "host" by the kernel, "copy" by a copy)"""
        if read == "host":
            out = model.forward_greedy(t, [slot])
        else:
            out = model.forward(t, [slot], greedy=True)
            out = Chosen.copy_back(out) if read == "copy" else Chosen(out, out, None)
        kv.rollback(slot, CONTEXT)
        return out

    tok = forward(forward(tok).tokens).tokens  # capture, then one replay
    cap = model.graphs[(1, 1, False, True)]
    meta = torch.empty_like(cap.inputs, device="cpu").pin_memory()
    meta.copy_(cap.inputs)
    host = torch.empty(1, dtype=torch.long).pin_memory()

    def loop(read: str):
        t = tok
        pending = None
        for _ in range(steps):
            chosen = forward(t, read)
            t = chosen.tokens
            if read != "none":
                if pending is not None:
                    pending.read()
                pending = chosen
        if pending is not None:
            pending.read()

    def bare(h2d: bool, d2h: bool):
        pending = None
        for _ in range(steps):
            if h2d:
                cap.inputs.copy_(meta, non_blocking=True)
            cap.graph.replay()
            if d2h:
                if pending is not None:
                    pending.synchronize()
                host.copy_(cap.tokens[:, 0], non_blocking=True)
                pending = torch.cuda.Event()
                pending.record()

    cases = [("loop (time_steps): ids written to the host by the argmax", lambda: loop("host")),
             ("loop, ids copied back on the stream", lambda: loop("copy")),
             ("loop without reading the ids", lambda: loop("none")),
             ("replay alone", lambda: bare(False, False)),
             ("replay + copy back", lambda: bare(False, True)),
             ("replay + metadata copy", lambda: bare(True, False)),
             ("replay + both copies", lambda: bare(True, True))]
    rows = []
    for label, fn in cases:
        walls = []
        for _ in range(3):
            fn()  # warm-up of this variant
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / steps * 1e6)
        rows.append((label, statistics.median(walls)))
    kv.free(slot)
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, batch 1, {CONTEXT} cached tokens, "
          f"{args.steps} steps; wall us per step (median of 3 runs)")
    print("| model | variant | us / step |\n| --- | --- | ---: |")
    for name in args.models.split(","):
        for label, us in probe(name, args.steps):
            print(f"| {name} | {label} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
