"""`kestrel generate`: load a model folder or a dummy preset and generate tokens.

    kestrel generate --model qwen3-8b --prompt-ids 1,2,3 --max-new-tokens 64 --quant int4

Backends: `torch` (the reference, CPU or CUDA) and `cupy` (CUDA kernels + CUDA graphs;
the default on a CUDA device when cupy is installed). `--quant int8|int4` quantizes the
projection weights at load (kestrel_rt/quant_weights.py); an AWQ folder loads as it is
(int4). torch is imported inside the command only, so the simulator's CLI works without it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kestrel_sim.errors import KestrelError


class PromptError(KestrelError):
    """A prompt that cannot run: missing, doubled, unparsable, or too long for the context."""


class OptionError(KestrelError):
    """A --backend / --quant / --no-graphs choice that cannot run here or on this model."""


BACKENDS = ("torch", "cupy")
QUANTS = ("none", "int8", "int4")
INSTALL_HINT = ('install cupy with pip install -e ".[cuda13]" (CUDA 13 driver) or '
                'pip install -e ".[cuda12]" (CUDA 12 driver)')


def pick_backend(backend: str | None, device: Any, graphs: bool) -> str:
    """The backend to build: --backend as given (checked), else cupy on CUDA with cupy."""
    from kestrel_rt.options import cupy_installed

    if backend is None:
        return "cupy" if device.type == "cuda" and cupy_installed() else "torch"
    if backend not in BACKENDS:
        raise OptionError(f"--backend '{backend}' is not a backend: expected one of "
                          f"{', '.join(BACKENDS)}")
    if backend == "torch" and not graphs:
        raise OptionError("--no-graphs applies to the cupy backend only (the torch backend "
                          "never captures CUDA graphs); drop --no-graphs or use --backend cupy")
    if backend == "cupy":
        missing = []
        if device.type != "cuda":
            missing.append(f"a CUDA device (the device is '{device}'; pass --device cuda on a "
                           "machine with an NVIDIA GPU)")
        if not cupy_installed():
            missing.append("the cupy package, which is not installed")
        if missing:
            raise OptionError(
                f"--backend cupy runs CUDA kernels and needs {' and '.join(missing)}; "
                f"{INSTALL_HINT}, or use --backend torch")
    return backend


def check_quant(quant: str | None, shape: Any, awq: bool, where: str) -> str:
    """The quantization to report ('none', 'int8', 'int4'), refusing what cannot apply."""
    from kestrel_rt.quant import GROUP_SIZE, int4_fits
    from kestrel_rt.quant_weights import is_projection
    from kestrel_rt.weights import expected_tensors

    if quant is not None and quant not in QUANTS:
        raise OptionError(f"--quant '{quant}' is not supported: expected one of "
                          f"{', '.join(QUANTS)}")
    if awq:
        if quant in ("none", "int8"):
            raise OptionError(
                f"{where} is a pre-quantized AWQ checkpoint (int4, group {GROUP_SIZE}) and loads "
                f"as it is; --quant {quant} cannot apply to it: leave --quant out (or pass "
                "--quant int4), or quantize the bf16 source folder instead")
        return "int4"
    quant = quant or "none"
    if quant == "int4":
        for name, dims in expected_tensors(shape).items():
            if is_projection(name) and not int4_fits(dims[-2], dims[-1]):
                raise OptionError(
                    f"--quant int4 cannot apply to {where}: tensor '{name}' has shape "
                    f"{list(dims)}, and int4 needs in_features a multiple of {GROUP_SIZE} and "
                    "out_features a multiple of 8; use --quant int8 or leave --quant out")
    return quant


def parse_prompt_ids(text: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3]; anything else is a PromptError naming the bad item."""
    ids = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit():
            raise PromptError(
                f"--prompt-ids '{text}': '{item}' is not a token id; expected non-negative "
                "integers separated by commas, e.g. --prompt-ids 1,2,3"
            )
        ids.append(int(item))
    return ids


def _json_key(path: Path, key: str) -> Any:
    """path's top-level `key`, or None when the file is absent or not a JSON object."""
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def eos_ids(folder: Path | None, tokenizer: Any | None) -> list[int]:
    """End-of-sequence ids as transformers' generate finds them: generation_config.json's
    eos_token_id, else config.json's, else the tokenizer's; [] if none."""
    sources = [] if folder is None else [folder / "generation_config.json", folder / "config.json"]
    found, where = None, None
    for path in sources:
        found, where = _json_key(path, "eos_token_id"), path
        if found is not None:
            break
    if found is None and tokenizer is not None:
        found, where = tokenizer.eos_token_id, "the tokenizer"
    if found is None:
        return []
    ids = found if isinstance(found, list) else [found]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise KestrelError(f"eos_token_id in {where} is {found!r}: expected a token id or a "
                           "list of token ids (or pass --ignore-eos)")
    return ids


def check_prompt(ids: list[int], max_new_tokens: int, shape: Any) -> None:
    """Refuse, before any weights load, a prompt the model cannot run."""
    n, ctx = len(ids), shape.max_position_embeddings
    if n + max_new_tokens > ctx:
        raise PromptError(
            f"the prompt has {n} tokens and --max-new-tokens is {max_new_tokens}, "
            f"{n + max_new_tokens} in all, but model '{shape.name}' has a context of {ctx} tokens "
            f"(max_position_embeddings); expected prompt tokens + --max-new-tokens <= {ctx}"
        )
    bad = [t for t in ids if t >= shape.vocab_size]
    if bad:
        raise PromptError(
            f"token id {bad[0]} is outside the vocabulary of model '{shape.name}': expected "
            f"ids in 0..{shape.vocab_size - 1}"
        )


def generate(
    model: Annotated[str, typer.Option(
        help="A Hugging Face model folder (config.json + *.safetensors), a hub id already in "
        "the local Hugging Face cache (Qwen/Qwen3-8B; never downloaded), or a preset name "
        "(qwen3-0.6b ... qwen3-32b, qwen3-30b-a3b) for random weights of the real shapes.")],
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")],
    prompt: Annotated[str | None, typer.Option(
        help="Prompt text (needs a tokenizer in the model folder).")] = None,
    prompt_ids: Annotated[str | None, typer.Option(
        help="Prompt as token ids, comma separated: 1,2,3.")] = None,
    device: Annotated[str | None, typer.Option(
        help="cpu or cuda[:N] (default: cuda when available, else cpu).")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="bfloat16, float16 or float32 (default: the folder's dtype; for presets and AWQ "
        "folders bfloat16 on CUDA, float32 on CPU).")] = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    seed: Annotated[int | None, typer.Option(
        help="Seed for sampling (random if omitted). Dummy weights always use seed 0.")] = None,
    ignore_eos: Annotated[bool, typer.Option(
        help="Do not stop at the end-of-sequence token.")] = False,
    backend: Annotated[str | None, typer.Option(
        help="torch or cupy (default: cupy on a CUDA device when cupy is installed, else "
        "torch).")] = None,
    graphs: Annotated[bool, typer.Option(
        "--graphs/--no-graphs", help="cupy backend: replay decode steps as CUDA graphs.")] = True,
    quant: Annotated[str | None, typer.Option(
        help="none, int8 or int4: quantize the projection weights at load (default: none; "
        "an AWQ folder is int4 as stored).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    draft: Annotated[str | None, typer.Option(
        help="Speculative decoding: the draft model (folder, hub id or preset), its own "
        "instance on its own backend.")] = None,
    k: Annotated[int, typer.Option(help="Draft tokens per round (1..16).")] = 4,
    correction: Annotated[str, typer.Option(
        help="fused (the correction / bonus token from the verify logits) or separate (an "
        "extra one-token target forward every round).")] = "fused",
    draft_device: Annotated[str | None, typer.Option(
        help="Where the draft runs: cpu or cuda[:N] (default: the target's device).")] = None,
    alpha: Annotated[float | None, typer.Option(
        min=0.0, max=1.0, help="Controlled acceptance: each draft token accepted with this "
        "probability (the real draft, verify and correction work still runs).")] = None,
) -> None:
    """Generate tokens with the runtime from a model folder or a dummy preset, plainly or
    speculatively with --draft."""
    import torch

    from kestrel_rt.engine import check_sampling
    from kestrel_rt.engine import generate as run_generate
    from kestrel_rt.loading import default_dtype, is_awq_checkpoint, load_tokenizer, resolve
    from kestrel_rt.memory import check_fits, free_bytes
    from kestrel_rt.options import default_options, kernel_cache_dir, kernel_cache_filled
    from kestrel_rt.runner import build_model, prepare
    from kestrel_rt.weights import parse_device, parse_dtype

    check_sampling(temperature, top_p, seed)
    if (prompt is None) == (prompt_ids is None):
        raise PromptError(
            "give exactly one of --prompt TEXT or --prompt-ids 1,2,3 "
            f"(got {'both' if prompt is not None else 'neither'})"
        )
    ids = parse_prompt_ids(prompt_ids) if prompt_ids is not None else None
    dev = parse_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape, folder = resolve(model)
    dt = parse_dtype(dtype or default_dtype(folder, dev))
    use = pick_backend(backend, dev, graphs)
    awq = folder is not None and is_awq_checkpoint(folder)
    where = f"model folder {folder}" if folder is not None else f"preset '{model}'"
    quant = check_quant(quant, shape, awq, where)
    tokenizer = load_tokenizer(folder) if folder is not None else None
    if ids is None:
        if tokenizer is None:
            where = f"model folder {folder}" if folder else f"preset '{model}' (random weights)"
            raise PromptError(
                f"--prompt needs a tokenizer, and {where} has none (no tokenizer.json or "
                "tokenizer_config.json); pass token ids with --prompt-ids 1,2,3 instead"
            )
        ids = tokenizer(prompt)["input_ids"]
        if not ids:
            raise PromptError(f"--prompt '{prompt}' encodes to no tokens")
    check_prompt(ids, max_new_tokens, shape)
    eos = None if ignore_eos else eos_ids(folder, tokenizer)
    options = default_options(dev, shape, quant, backend=use,
                              **({} if use == "torch" else {"graphs": graphs}))
    if not awq:  # the cupy graph runner keeps a scratch slot as large as the sequence's
        slots = 2 if options.graphs else 1
        check_fits(shape, dt, dev, free_bytes(dev), slots * (len(ids) + max_new_tokens))
    if options.backend == "cupy" and not kernel_cache_filled() and not as_json:
        print(f"compiling the CUDA kernels (first run on this machine: cupy caches them in "
              f"{kernel_cache_dir()})", file=sys.stderr)

    draft_shape = None
    if draft is not None:
        from kestrel_cli.draft import check_draft

        draft_shape = check_draft(draft, k, correction, shape)

    t0 = time.perf_counter()
    runner = build_model(model, dev, dt, quant, options, seed=0)
    spec_k = k if draft is not None else 0
    prepare(runner, 1, len(ids) + max_new_tokens + spec_k, prefill=(len(ids),),
            new_tokens=(1, spec_k + 1) if spec_k else (1,))
    load_s = time.perf_counter() - t0

    spec = {}
    if draft is None:
        result = run_generate(
            runner, [ids], max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
            eos_token_id=eos,
        )
    else:
        from kestrel_cli.draft import run_speculative

        ddev = parse_device(draft_device) if draft_device else dev
        result, draft_load_s = run_speculative(
            runner, draft, draft_shape, ddev, ids, max_new_tokens, k, correction, temperature,
            top_p, seed, eos, alpha)
        load_s += draft_load_s
        spec = {"draft": draft, "draft_device": str(ddev), "correction": correction,
                "rounds": result.decode_steps, "rounds_ahead": result.rounds_ahead,
                **result.stats.as_dict()}
    new_ids = result.token_ids[0]
    text = tokenizer.decode(new_ids, skip_special_tokens=True) if tokenizer else None
    report = {
        "model": str(model),
        "device": str(dev),
        "dtype": str(dt).removeprefix("torch."),
        "backend": use,
        "quant": quant,
        "awq": awq,
        "graphs": options.graphs,
        "prompt_tokens": len(ids),
        "generated_tokens": len(new_ids),
        "token_ids": new_ids,
        "text": text,
        "tokens_per_s": result.tokens_per_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "elapsed_s": result.prefill_s + result.decode_s,
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "load_s": load_s,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        **spec,
    }
    if as_json:
        typer.echo(json.dumps(report))
        return
    typer.echo(text if text is not None else ",".join(map(str, new_ids)))
    print(
        f"{len(new_ids)} tokens in {report['elapsed_s']:.3f} s: {result.tokens_per_s:.1f} tok/s "
        f"(decode {result.decode_tokens_per_s:.1f} tok/s; prompt {len(ids)} tokens; "
        f"{shape.name} on {dev}, {report['dtype']}, {use} backend, quant {quant}; "
        f"load {load_s:.1f} s, kernel compilation and graph capture included)",
        file=sys.stderr,
    )
    if spec:
        print(f"speculative: draft {draft} on {spec['draft_device']}, k {k}, {correction}; "
              f"acceptance length {spec['spec_decode_acceptance_length']:.2f}, rate "
              f"{spec['spec_decode_acceptance_rate']:.1f}%"
              + (" (controlled)" if spec["spec_decode_controlled"] else ""), file=sys.stderr)
