"""qwen3-30b-a3b prefill with its MoE chunk eager and replayed as a CUDA graph (dummy weights).

    python bench/moe_prefill_bench.py [--out DIR] [--commit HASH] [--reps 5]

The model `kestrel generate` runs (bench/h200_decode.py build: bf16, the device's default
options) once with RuntimeOptions.moe_prefill_graphs off (today: a MoE prefill runs eagerly,
bound by the host's ~24 us per torch op) and once on (the chunk padded to its prefill bucket
and replayed: kestrel_rt/moe.py static_experts_forward); one prompt of each length into an
empty slot, CUDA-event timed (median of --reps after one warm-up, which captures the graph).
Prints a markdown table (and writes DIR/moe_prefill_bench.md): ms per prefill off and on, the
speed-up, the graphs replayed and captured, and the relative error of the last token's logits
on against off (the same dummy weights).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure
from h200_decode import build

MODEL = "qwen3-30b-a3b"
LENGTHS = (512, 2048)


def run(graphs_on: bool, reps: int) -> dict:
    """{length: (ms, last-token logits [V] on the CPU)} and the model's replay / capture
    counts, for one build of the model with moe_prefill_graphs set to graphs_on."""
    model = build(MODEL, "bf16", moe_prefill_graphs=graphs_on)
    model.allocate_kv(1, max(LENGTHS) + 16)
    gen = torch.Generator().manual_seed(0)
    result: dict = {"lengths": {}}
    for length in LENGTHS:
        r = measure.time_prefill(model, length, reps, gen)
        prompt = torch.randint(0, model.shape.vocab_size, (1, length),
                               generator=torch.Generator().manual_seed(length))
        slot = model.kv.allocate()
        logits = model.forward(prompt, [slot], last_only=True)[0].float().cpu()  # [V]
        model.kv.free(slot)
        result["lengths"][length] = (r["ms"], logits)
    result["replays"] = getattr(model, "replays", 0)
    result["captures"] = getattr(model, "captures", 0)
    result["capture_s"] = getattr(model, "capture_s", 0.0)
    del model
    torch.cuda.empty_cache()
    return result


def table(off: dict, on: dict, commit: str, device: str) -> list[str]:
    """The markdown table of run(False, ...) and run(True, ...)."""
    lines = [(f"{MODEL} prefill, one sequence, bf16 dummy weights; "
             f"{device}, {time.strftime('%Y-%m-%d')}, commit {commit}"),
             "",
             "| tokens | eager ms | graphed ms | speed-up | logits rel err |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for length in LENGTHS:
        (ms_off, ref), (ms_on, got) = off["lengths"][length], on["lengths"][length]
        err = ((got - ref).norm() / ref.norm()).item()
        lines.append(f"| {length} | {ms_off:.1f} | {ms_on:.1f} | {ms_off / ms_on:.2f}x "
                     f"| {err:.1e} |")
    lines += ["", (f"moe_prefill_graphs on: {on['replays']} replays, {on['captures']} graphs "
              f"captured in {on['capture_s']:.1f} s; off: {off['replays']} replays, "
              f"{off['captures']} captured")]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    off = run(False, args.reps)
    try:
        on = run(True, args.reps)
    except Exception:  # report the eager rows, then what failed
        for length, (ms, _) in off["lengths"].items():
            print(f"eager prefill of {length} tokens: {ms:.1f} ms")
        raise
    lines = table(off, on, args.commit, torch.cuda.get_device_name())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_prefill_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
