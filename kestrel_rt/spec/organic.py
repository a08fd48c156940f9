"""Organic draft models on dummy weights: drafts that agree with their target for real.

A random draft never agrees with a random target, so these drafts are made from the target's
own (dummy) weights, as copies (each draft is its own model instance on its own backend):

- `quantized_weights`: the target with its projections quantized, the last N layers to int4
  and the others to int8 (N = 0: an int8 copy; N = all layers: an int4 copy);
- `layer_skip_weights`: the target's first N layers with its embedding, final norm and LM
  head (a layer-skip self-draft).

Per-token agreement (greedy acceptance: the draft's argmax given the target's own greedy
prefix) with qwen3-0.6b, fp32, 6 random prompts of 16 tokens, 32 new tokens (192 positions):

| draft                                       | agreement |
| ------------------------------------------- | --------- |
| int8 copy (int4 layers 0)                   | 0.927     |
| int4 in the last 4 / 8 layers               | 0.865 / 0.828 |
| int4 in the last 14 layers (the default)    | 0.672     |
| int4 in the last 20 layers                  | 0.635     |
| int4 copy (all 28 layers)                   | 0.229     |
| layer skip: embedding, norm and head only   | 0.677     |
| layer skip: the first 1 / 14 layers         | 0.005 / 0.026 |

    python -m kestrel_rt.spec.organic --preset qwen3-0.6b --threads 1

Decoding speculatively with the default draft, k = 4 (`--int4-layers 14 --skip-layers
--k 4`): the same tokens as plain greedy, acceptance length 2.39, conditional acceptance per
position 0.49 / 0.76 / 0.89 / 0.77.

On dummy weights every layer adds a large random change to the residual stream, so a
layer-skip draft with some but not all layers hardly ever agrees; the one with none does (the
dummy target often repeats its input token, which embedding + norm + tied LM head predicts).
Quantization noise lowers agreement more smoothly, and less when it enters late layers.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.model import Qwen3Model
from kestrel_rt.quant_weights import QuantizedWeight, is_projection, layer_of, quantize_weights
from kestrel_rt.weights import dummy_weights, load_dummy, parse_dtype
from kestrel_sim.errors import KestrelError
from kestrel_sim.models import ModelShape

DEFAULT_INT4_LAYERS = 14  # of qwen3-0.6b's 28: per-token acceptance 0.67 (module doc)


def layer_skip_weights(shape: ModelShape, hf: dict[str, torch.Tensor], layers: int
                       ) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """(shape, copies of the weights) of the target's first `layers` layers with its
    embedding, final norm and LM head."""
    if not 0 <= layers <= shape.num_hidden_layers:
        raise KestrelError(f"a layer-skip draft of '{shape.name}' keeps 0.."
                           f"{shape.num_hidden_layers} layers, not {layers}")
    kept = {name: t.clone() for name, t in hf.items()
            if (layer_of(name) is None or layer_of(name) < layers)}
    draft = shape.model_copy(update={"num_hidden_layers": layers,
                                     "name": f"{shape.name}-first{layers}"})
    return draft, kept


def quantized_weights(shape: ModelShape, hf: dict[str, torch.Tensor], int4_layers: int
                      ) -> tuple[ModelShape, dict[str, object]]:
    """(shape, a quantized copy): projections of the last `int4_layers` layers in int4, the
    others in int8; embedding, norms and LM head copied as they are."""
    layers = shape.num_hidden_layers
    if not 0 <= int4_layers <= layers:
        raise KestrelError(f"int4_layers of '{shape.name}' is 0..{layers}, not {int4_layers}")
    copy = {name: t if is_projection(name) else t.clone() for name, t in hf.items()}
    out = quantize_weights(copy, f"int4-last-{int4_layers}", layers)  # projections: new objects
    draft = shape.model_copy(update={"name": f"{shape.name}-int4x{int4_layers}"})
    return draft, out


def dequantized(hf: dict[str, object], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Quantized weights as plain tensors of the values they stand for (the same numbers the
    torch backend computes with, without dequantizing at every forward: CPU measurements)."""
    return {n: w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w
            for n, w in hf.items()}


def organic_pair(preset: str | ModelShape, kind: str = "quantized",
                 layers: int = DEFAULT_INT4_LAYERS, device: str = "cpu", dtype: str = "float32",
                 draft_device: str | None = None, seed: int = 0
                 ) -> tuple[Qwen3Model, Qwen3Model]:
    """(target, draft) on torch backends: dummy weights of `preset` (a name or a shape) and
    a draft of `kind` "quantized" (int4_layers = layers) or "layer_skip" (the first
    `layers` layers)."""
    if isinstance(preset, ModelShape):
        shape, hf = preset, dummy_weights(preset, device, dtype, seed)
    else:
        shape, hf = load_dummy(preset, device, dtype, seed)
    if kind == "quantized":
        dshape, dhf = quantized_weights(shape, hf, layers)
    elif kind == "layer_skip":
        dshape, dhf = layer_skip_weights(shape, hf, layers)
    else:
        raise KestrelError(f"organic draft kind '{kind}': expected quantized or layer_skip")
    target = Qwen3Model(shape, hf, TorchBackend(device, parse_dtype(dtype)))
    ddev = draft_device or device
    dhf = {n: w.to(device=ddev) for n, w in dhf.items()}
    draft = Qwen3Model(dshape, dhf, TorchBackend(ddev, target.backend.dtype))
    return target, draft


def agreement(target_tokens: list[list[int]], prompts: list[list[int]], draft: Qwen3Model
              ) -> tuple[int, int]:
    """(agreeing, positions): how often the draft's argmax, given the target's own greedy
    prefix, is the target's next token (teacher-forced: greedy speculative decoding's
    per-token acceptance)."""
    draft.allocate_kv(1, max(len(p) + len(t) for p, t in zip(prompts, target_tokens)))
    agree = total = 0
    for prompt, gen in zip(prompts, target_tokens):
        slot = draft.kv.allocate()
        ids = draft.forward(torch.tensor([prompt + gen[:-1]]), [slot], greedy=True)[0]  # [L]
        pred = ids[len(prompt) - 1:].tolist()
        agree += sum(a == b for a, b in zip(pred, gen))
        total += len(gen)
        draft.kv.free(slot)
    return agree, total


def main(argv: list[str] | None = None) -> None:
    from kestrel_rt.engine import generate
    from kestrel_rt.spec import SpecConfig, speculative_generate

    ap = argparse.ArgumentParser(description="Per-token agreement of organic drafts with a "
                                 "dummy-weight target (CPU torch backend), one JSON line each.")
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--int4-layers", type=int, nargs="*", default=[0, 4, 8, 14, 20, 28])
    ap.add_argument("--skip-layers", type=int, nargs="*", default=[0, 1, 14])
    ap.add_argument("--k", type=int, default=None,
                    help="also decode speculatively with each draft (k proposals a round)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    shape, hf = load_dummy(args.preset, "cpu", args.dtype, args.seed)
    source = {n: t.clone() for n, t in hf.items()}  # the target's load pops hf
    dtype = parse_dtype(args.dtype)
    target = Qwen3Model(shape, hf, TorchBackend("cpu", dtype))
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, shape.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    tokens = generate(target, prompts, args.new).token_ids
    drafts = [("quantized", n) for n in args.int4_layers] + \
        [("layer_skip", n) for n in args.skip_layers]
    for kind, n in drafts:
        if kind == "quantized":
            dshape, dhf = quantized_weights(shape, source, n)
            dhf = dequantized(dhf, dtype)  # the same numbers, not dequantized every forward
        else:
            dshape, dhf = layer_skip_weights(shape, source, n)
        draft = Qwen3Model(dshape, dhf, TorchBackend("cpu", dtype))
        agree, total = agreement(tokens, prompts, draft)
        row = {"preset": args.preset, "dtype": args.dtype, "draft": kind, "layers": n,
               "agreement": round(agree / total, 4), "positions": total}
        if args.k:
            got = speculative_generate(target, draft, prompts, args.new, SpecConfig(k=args.k))
            stats = got.stats.as_dict()
            row.update(same_tokens=got.token_ids == tokens, k=args.k,
                       acceptance_length=round(stats["spec_decode_acceptance_length"], 3),
                       conditional_rates=[round(r, 3) for r in got.stats.conditional_rates()])
        row["seconds"] = round(time.perf_counter() - t0)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
