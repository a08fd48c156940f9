"""Verify forwards with the tensor-core verify attention (RuntimeOptions.mma_verify) off and on.

    python bench/probes/verify_probe.py [--model qwen3-8b] [--batches 1,8,32,64] [--ms 2,5,9]
                                        [--contexts 512,2048] [--reps 5]

Why: a verify forward's R = M * Hq / Hkv query rows per kv head (qwen3-8b: M = 5 gives 20)
exceed the warp-per-key decode kernel's 8, so they ran on attn_partial (CUDA cores, fp32
tiles), about 3.4 TFLOP/s in the calibration fit: qwen3-8b at batch 64, context 2048 took
150.7 ms where its bandwidth limit is about 10 ms (calibration/profiles/qwen3-8b_h200.json).
kernels/verify_attention.cu takes those shapes on the tensor cores.

Two models with the same dummy weights (seed 0) and the same random KV cache contents, one
with mma_verify off and one with it on (otherwise the device's default options), each
forward a graph replay as calibration times it (`forward(tokens, slots, greedy=True)`, every
sequence at `context` cached tokens, CUDA events, median of `reps` after two warm-ups). The
outputs: both models' logits of the same forward (max abs difference, relative error, argmax
agreement). Contexts run longest first, so no forward reads a position another one of a
different model state wrote. M = 2 (8 rows) stays on the decode kernel either way: a control.
A first table times the attention op alone (one layer's cache, 36 calls in a CUDA graph).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from calibration.measure import set_lengths
from kestrel_rt.cuda import attention
from kestrel_rt.cuda.timing import time_graph
from kestrel_rt.loading import resolve
from kestrel_rt.options import default_options
from kestrel_rt.runner import build_model, prepare


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def timed(fn, reps: int, warmup: int = 2, setup=None) -> float:
    """Median ms of fn() between CUDA events, after `warmup` calls; setup() before each,
    untimed."""
    times = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_forward(model, tokens: torch.Tensor, slots: list[int], context: int,
                 reps: int) -> tuple[float, torch.Tensor]:
    """(median ms of the greedy forward of tokens [b, M] at `context` cached tokens, its
    logits [b, M, V] from the same state)."""
    def setup() -> None:
        set_lengths(model.kv, slots, context)

    ms = timed(lambda: model.forward(tokens, slots, greedy=True), reps, setup=setup)
    set_lengths(model.kv, slots, context)
    return ms, model.forward(tokens, slots).float()


def forward_table(models: dict, taken: list[int], args) -> list[tuple]:
    """(batch, M, context, ms off, ms on, max abs diff, relative error, argmax agreement);
    taken: KV slots allocated (the same in both models)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for c in sorted(args.contexts, reverse=True):
        for b in args.batches:
            for m in args.ms:
                tokens = torch.randint(0, 1000, (b, m), generator=g)  # [b, M]
                (off, lo), (on, hi) = (time_forward(models[x], tokens, taken[:b], c, args.reps)
                                       for x in (False, True))
                diff = (hi - lo).abs().max().item()
                rel = ((hi - lo).norm() / lo.norm()).item()
                agree = (hi.argmax(-1) == lo.argmax(-1)).float().mean().item()
                rows.append((b, m, c, off, on, diff, rel, agree))
                print(f"b={b} M={m} c={c}: {off:.2f} -> {on:.2f} ms", flush=True)
    return rows


def time_attention(km, q, kc, vc, slots, positions, sms: int, on: bool, reps: int,
                   calls: int = 36) -> float:
    """us per call of decode_attention(q [b, M, Hq, D] over kc, vc [slots, max_len, Hkv, D],
    mma_verify=on), `calls` launches captured in one graph (36: a qwen3-8b forward's)."""
    out = torch.empty_like(q)

    def layers() -> None:
        for _ in range(calls):
            attention.decode_attention(km, q, kc, vc, slots, positions, sms, out=out,
                                       mma_verify=on)

    return time_graph(layers, reps) * 1e6 / calls  # warmed outside the capture, then replayed


def attention_table(model, args) -> list[tuple]:
    """(batch, M, context, plan, us off, us on) of the attention op alone: the model's heads
    over its layer-0 cache."""
    s, km, sms = model.shape, model.backend.kernels, model.backend.num_sms
    Hq, Hkv, D = s.num_attention_heads, s.num_key_value_heads, s.head_dim
    kc, vc = model.kv.k[0], model.kv.v[0]  # [slots, max_len, Hkv, D]
    rows = []
    for c in sorted(args.contexts, reverse=True):
        for b in args.batches:
            for m in args.ms:
                q = torch.randn(b, m, Hq, D, device="cuda", dtype=kc.dtype)  # [b, M, Hq, D]
                slots = torch.arange(b, device="cuda")
                positions = (c + torch.arange(m, device="cuda"))[None, :].expand(b, m)
                positions = positions.contiguous()  # [b, M]
                off, on = (time_attention(km, q, kc, vc, slots, positions, sms, x, args.reps)
                           for x in (False, True))
                plan = attention.verify_plan(b, m, Hq, Hkv, D, kc.shape[1], sms)
                rows.append((b, m, c, plan, off, on))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64])
    ap.add_argument("--ms", type=ints, default=[2, 5, 9])
    ap.add_argument("--contexts", type=ints, default=[512, 2048])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    shape, _ = resolve(args.model)
    slots, max_len = max(args.batches), max(args.contexts) + max(args.ms) + 1
    models, taken = {}, {}
    for on in (False, True):
        options = default_options("cuda", shape, mma_verify=on)
        models[on] = build_model(args.model, "cuda", options=options, seed=0)
        prepare(models[on], slots, max_len, tuple(args.batches), tuple(args.ms), ())
        taken[on] = [models[on].kv.allocate() for _ in range(slots)]
    assert taken[False] == taken[True]
    g = torch.Generator(device="cuda").manual_seed(1)
    for kind in ("k", "v"):  # the same cache contents in both
        cache = getattr(models[False].kv, kind)
        cache.normal_(generator=g)
        getattr(models[True].kv, kind).copy_(cache)
    torch.cuda.synchronize()
    Hq, Hkv = shape.num_attention_heads, shape.num_key_value_heads
    attn = attention_table(models[False], args)  # first: kernel numbers even if time runs out
    print("\nattention op alone (one layer's cache, decode_attention), us per call; "
          "plan = attn_verify's (m-tiles, row groups, splits)\n")
    print("| batch | M | context | plan | us off | us on | speedup |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for b, m, c, plan, off, on in attn:
        print(f"| {b} | {m} | {c} | {plan} | {off:.1f} | {on:.1f} | {off / on:.2f}x |")
    print(flush=True)
    forwards = forward_table(models, taken[False], args)
    print(f"\n{args.model} verify forwards, mma_verify off / on, every sequence at `context` "
          f"cached tokens; ms, median of {args.reps} graph replays "
          f"({torch.cuda.get_device_name()})\n")
    print("| batch | M | context | rows R | ms off | ms on | speedup | max abs diff | rel err "
          "| argmax agree |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b, m, c, off, on, diff, rel, agree in forwards:
        print(f"| {b} | {m} | {c} | {m * Hq // Hkv} | {off:.2f} | {on:.2f} | {off / on:.2f}x | "
              f"{diff:.3g} | {rel:.2g} | {agree:.3f} |")


if __name__ == "__main__":
    main()
