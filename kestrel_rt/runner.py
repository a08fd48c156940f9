"""One way to build a ready model: weights, fold, quantization, backend, graphs.

    model = build_model("qwen3-8b", "cuda")                       # dummy weights, real shapes
    model = build_model("path/to/Qwen3-0.6B", "cpu", quant="int8")
    prepare(model, num_slots=4, max_len=2048)                       # KV cache, compile, capture

The CLI, serving, calibration, the benchmarks and the tests all build models here. A model
is a Hugging Face folder (config.json + safetensors, or an AWQ checkpoint, loaded as it is),
a hub id already in the local cache, or a preset name (random weights made on the device).
The options (kestrel_rt/options.py) default to what the device runs fastest. `prepare`
allocates the KV cache and, on the cupy backend, compiles every kernel the model will use and
captures its decode graphs, so that nothing is compiled or captured inside a timed run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.fold import fold_norms
from kestrel_rt.loading import default_dtype, is_awq_checkpoint, load_folder, resolve
from kestrel_rt.model import Qwen3Model
from kestrel_rt.options import RuntimeOptions, default_options
from kestrel_rt.quant_weights import UNQUANTIZED, quantize_weights
from kestrel_rt.weights import load_dummy, parse_device, parse_dtype
from kestrel_sim.errors import KestrelError


def build_model(model: str | Path, device: str | torch.device = "cpu",
                dtype: str | torch.dtype | None = None, quant: str | None = None,
                options: RuntimeOptions | None = None, seed: int = 0,
                model_id: str | None = None) -> Qwen3Model:
    """A model on its own backend, ready to allocate a KV cache and run.

    dtype None: the folder's declared dtype (bfloat16 for presets and AWQ folders on CUDA,
    float32 on the CPU); quant: None / "none", "int8", "int4" or "int4-last-N" (int4 in the
    last N layers, int8 in the others; projections quantized at load; an AWQ folder is int4
    as stored; a preset quantized with the same seed is a quantized copy of the same dummy
    weights, the organic draft of kestrel_rt/spec/organic.py); options None: default_options for the device,
    model and quantization; seed: the dummy weights' seed (presets)."""
    device = parse_device(device)
    shape, folder = resolve(model)
    awq = folder is not None and is_awq_checkpoint(folder)
    if awq and quant not in (*UNQUANTIZED, "int4"):
        raise KestrelError(f"model folder {folder} is an AWQ checkpoint (int4) and loads as it "
                           f"is; quantization '{quant}' cannot apply to it")
    dt = parse_dtype(dtype or default_dtype(folder, device))
    options = options or default_options(device, shape, None if awq else quant)
    if folder is not None:
        shape, weights = load_folder(folder, device, dt)
    else:
        shape, weights = load_dummy(shape.name, device, dt, seed=seed)
    if options.fold_norms and not awq and quant in UNQUANTIZED:
        shape, weights = fold_norms(shape, weights)
    if not awq:
        quantize_weights(weights, quant, shape.num_hidden_layers)
    if options.backend == "cupy":
        from kestrel_rt.backend.cupy_backend import CupyBackend

        backend = CupyBackend(device, dt, options)
    else:
        backend = TorchBackend(device, dt)
    if options.graphs:
        from kestrel_rt.cuda.graphs import GraphModel

        return GraphModel(shape, weights, backend, model_id=model_id)
    return Qwen3Model(shape, weights, backend, model_id=model_id)


def prepare(model: Qwen3Model, num_slots: int, max_len: int,
            batches: tuple[int, ...] = (1,), new_tokens: tuple[int, ...] = (1,),
            prefill: tuple[int, ...] = (32,)) -> None:
    """Allocate the model's KV cache (num_slots sequences of max_len tokens) and warm it up:
    on a GraphModel, the greedy prefill graphs of prompts of `prefill` tokens and the greedy
    decode graphs of `batches` x `new_tokens` (M) run on the scratch slot, so the kernels
    they need are compiled and the graphs captured now (the cupy kernel cache keeps compiled
    modules on disk for the next process). Nothing of the sequences' slots is touched."""
    model.allocate_kv(num_slots, max_len)
    warm = getattr(model, "warm", None)
    if warm is not None:
        warm(batches, new_tokens, prefill)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
