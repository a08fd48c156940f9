"""Verify forwards with the tensor-core verify attention (RuntimeOptions.mma_verify) off and on.

    python bench/probes/verify_probe.py [--model qwen3-8b] [--batches 1,8,32,64] [--ms 2,5,9]
                                        [--decode-batches 1,2,4,8,16,32,64]
                                        [--contexts 512,2048] [--reps 5]

Why: a verify forward's R = M * Hq / Hkv query rows per kv head (qwen3-8b: M = 5 gives 20)
exceed the warp-per-key decode kernel's 8, so they ran on attn_partial (CUDA cores, fp32
tiles), about 3.4 TFLOP/s in the calibration fit: qwen3-8b at batch 64, context 2048 took
150.7 ms where its bandwidth limit is about 10 ms (calibration/profiles/qwen3-8b_h200.json).
kernels/verify_attention.cu takes those shapes on the tensor cores.

Three models with the same dummy weights (seed 0) and the same random KV cache contents:
`off` (mma_verify off: verify rows on attn_partial), `on` (verify rows on attn_verify, decode
rows on the warp-per-key kernel) and `decode` (decode rows on attn_verify too,
mma_decode_min_batch 1). Each forward is a graph replay as calibration times it
(`forward(tokens, slots, greedy=True)`, every sequence at `context` cached tokens, CUDA
events, median of `reps` after two warm-ups). Tables: the attention op alone (one layer's
cache, 36 calls in a CUDA graph); decode forwards (M = 1, 2) `on` against `decode`; verify
forwards `off` against `on`, their logits compared with each other and with the same tokens
decoded one at a time on `off` (relative error, argmax agreement). The caches are filled
again before the verify forwards, which run longest context first: no compared forward reads
a position another model state wrote differently. (At a043d28 they were not, and the verify
rows at context 2048 compared caches that differed at positions 512-513: 0.3 relative error
there, 0.05 at context 512.)
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


def one_at_a_time(model, tokens: torch.Tensor, slots: list[int], context: int
                  ) -> torch.Tensor:
    """The reference for a verify forward: its M tokens [b, M] fed one decode step at a time
    from `context` cached tokens -> logits [b, M, V] (fp32)."""
    set_lengths(model.kv, slots, context)
    return torch.cat([model.forward(tokens[:, j:j + 1], slots).float()
                      for j in range(tokens.shape[1])], dim=1)


def compare(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative error, argmax agreement) of logits got against ref [b, M, V]."""
    return (((got - ref).norm() / ref.norm()).item(),
            (got.argmax(-1) == ref.argmax(-1)).float().mean().item())


def forward_table(models: dict, taken: list[int], args, batches: list[int], ms: list[int],
                  pair: tuple[str, str], reference: bool) -> list[tuple]:
    """(batch, M, context, ms a, ms b, errors) for models pair = (a, b); errors: rel err and
    argmax agreement of b against a, and with `reference`, of a and of b against the tokens
    decoded one at a time on model a. taken: KV slots allocated (the same in all models)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for c in sorted(args.contexts, reverse=True):
        for b in batches:
            for m in ms:
                tokens = torch.randint(0, 1000, (b, m), generator=g)  # [b, M]
                (ta, la), (tb, lb) = (time_forward(models[x], tokens, taken[:b], c, args.reps)
                                      for x in pair)
                errs = compare(lb, la)
                if reference:
                    ref = one_at_a_time(models[pair[0]], tokens, taken[:b], c)
                    errs += compare(la, ref) + compare(lb, ref)
                rows.append((b, m, c, ta, tb, errs))
                print(f"{pair} b={b} M={m} c={c}: {ta:.2f} -> {tb:.2f} ms", flush=True)
    return rows


def print_forwards(rows: list[tuple], head: str, errors: list[str]) -> None:
    print(head)
    print("| batch | M | context | ms before | ms after | speedup | "
          + " | ".join(errors) + " |")
    print("| ---: " * (6 + len(errors)) + "|")
    for b, m, c, ta, tb, errs in rows:
        print(f"| {b} | {m} | {c} | {ta:.2f} | {tb:.2f} | {ta / tb:.2f}x | "
              + " | ".join(f"{e:.3g}" for e in errs) + " |", flush=True)


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


def same_caches(models: dict) -> None:
    """Every model's KV cache filled with the same random contents (seeded)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for kind in ("k", "v"):
        cache = getattr(models["off"].kv, kind)
        cache.normal_(generator=g)
        for name in models.keys() - {"off"}:
            getattr(models[name].kv, kind).copy_(cache)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64])
    ap.add_argument("--ms", type=ints, default=[2, 5, 9])
    ap.add_argument("--decode-batches", type=ints, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--contexts", type=ints, default=[512, 2048])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    shape, _ = resolve(args.model)
    batches = sorted(set(args.batches) | set(args.decode_batches))
    ms = sorted(set(args.ms) | {1, 2})
    slots, max_len = max(batches), max(args.contexts) + max(ms) + 1
    # off: attn_partial for verify rows; on: attn_verify for them; decode: and for decode rows
    settings = {"off": {"mma_verify": False},
                "on": {"mma_verify": True, "mma_decode_min_batch": None},
                "decode": {"mma_verify": True, "mma_decode_min_batch": 1}}
    models, taken = {}, {}
    for name, extra in settings.items():
        options = default_options("cuda", shape, **extra)
        models[name] = build_model(args.model, "cuda", options=options, seed=0)
        prepare(models[name], slots, max_len, tuple(batches), tuple(ms), ())
        taken[name] = [models[name].kv.allocate() for _ in range(slots)]
    assert taken["off"] == taken["on"] == taken["decode"]
    same_caches(models)
    attn = attention_table(models["off"], args)  # first: kernel numbers even if time runs out
    print("\nattention op alone (one layer's cache, decode_attention), us per call; "
          "plan = attn_verify's (m-tiles, row groups, splits)\n")
    print("| batch | M | context | plan | us off | us on | speedup |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for b, m, c, plan, off, on in attn:
        print(f"| {b} | {m} | {c} | {plan} | {off:.1f} | {on:.1f} | {off / on:.2f}x |")
    print(flush=True)
    gpu = torch.cuda.get_device_name()
    decode = forward_table(models, taken["off"], args, args.decode_batches, [1, 2],
                           ("on", "decode"), reference=False)
    same_caches(models)  # the decode forwards wrote their tokens' K/V into two of them
    verify = forward_table(models, taken["off"], args, args.batches,
                           [m for m in args.ms if m > 2], ("off", "on"), reference=True)
    print_forwards(decode, f"\n{args.model} decode forwards (M = 1, 2), the decode kernel "
                   f"(before) against attn_verify (after, mma_decode_min_batch 1); ms, median "
                   f"of {args.reps} graph replays ({gpu})\n", ["rel err", "argmax agree"])
    print_forwards(verify, f"\n{args.model} verify forwards, mma_verify off (before) / on "
                   f"(after); errors against each other and against the same tokens decoded "
                   f"one at a time (model off); ms, median of {args.reps} graph replays "
                   f"({gpu})\n", ["rel err", "agree", "off vs seq", "agree", "on vs seq",
                                   "agree"])


if __name__ == "__main__":
    main()
