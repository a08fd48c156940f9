"""Pre-quantized AWQ checkpoints, loaded as they are (kestrel_rt/awq_write.py writes one).

An AWQ folder (autoawq's GEMM format) is a Hugging Face folder whose linear projections are
stored as three tensors in place of `X.weight`:
  X.qweight int32 [in, out/8], X.qzeros int32 [in/128, out/8], X.scales fp16 [in/128, out]
(kestrel_rt/quant.py describes the packing), with config.json's `quantization_config` saying
`quant_method: awq`, `bits: 4`, `group_size: 128`, `zero_point: true`. Everything else
(embeddings, norms, router, lm_head) is stored as usual.

`load_awq_folder` returns (shape, weights) like `kestrel_rt.loading.load_folder`, with an
`Int4Weight` under each projection's `X.weight` name, so the model and backends take it
unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kestrel_rt import quant
from kestrel_rt.config import read_config, shape_from_hf_config
from kestrel_rt.quant_weights import Int4Weight, is_projection
from kestrel_rt.safetensors_files import read_headers, weight_files
from kestrel_rt.weights import expected_tensors, parse_device, parse_dtype
from kestrel_sim.errors import KestrelError
from kestrel_sim.models import ModelShape

AWQ_SUFFIXES = ("qweight", "qzeros", "scales")


class AwqCheckpointError(KestrelError):
    """An AWQ folder whose config or tensors are not the supported format."""


def _read_all(folder: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """{tensor name: (file, shape, dtype)} over the folder's weight files (single, or shards
    named by the index), from the headers; a truncated or corrupt file is a clear error."""
    return read_headers(weight_files(folder))


def _check_config(config: dict, where: Path) -> None:
    qc = config.get("quantization_config") or {}
    if not qc:
        return  # tensors alone say AWQ; assume autoawq's defaults, checked by shape below
    want = {"bits": 4, "group_size": quant.GROUP_SIZE, "zero_point": True}
    for key, value in want.items():
        if key in qc and qc[key] != value:
            raise AwqCheckpointError(
                f"{where}: quantization_config.{key} is {qc[key]!r}; Kestrel loads AWQ "
                f"checkpoints with bits=4, group_size={quant.GROUP_SIZE}, zero_point=true"
            )
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise AwqCheckpointError(
            f"{where}: quantization_config.version is {version!r}; expected 'gemm' "
            "(autoawq's GEMM packing: qweight [in, out/8])"
        )


def _expect(name: str, got: tuple[int, ...], want: tuple[int, ...], path: Path) -> None:
    if got != want:
        raise AwqCheckpointError(
            f"{path}: tensor '{name}' has shape {list(got)}, expected {list(want)} for AWQ "
            f"int4 with group size {quant.GROUP_SIZE}"
        )


def load_awq_folder(
    folder: str | Path, device: str | torch.device, dtype: str | torch.dtype = "bfloat16"
) -> tuple[ModelShape, dict]:
    """(shape, weights by HF name) of an AWQ folder: projections as Int4Weight on `device`,
    every other tensor in `dtype`."""
    from safetensors import safe_open

    folder = Path(folder)
    config_path = folder / "config.json"
    config = read_config(config_path)
    _check_config(config, config_path)
    shape = shape_from_hf_config(config, config_path)
    device, dtype = parse_device(device), parse_dtype(dtype)
    found = _read_all(folder)
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        path = found[name][0]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt", device=str(device))
        return handles[path].get_tensor(name)

    weights: dict = {}
    for name, dims in expected_tensors(shape).items():
        base = name.removesuffix(".weight")
        if is_projection(name) and f"{base}.qweight" in found:
            out_f, in_f = dims
            g = in_f // quant.GROUP_SIZE
            parts = {}
            for suffix, want in zip(AWQ_SUFFIXES, ((in_f, out_f // 8), (g, out_f // 8),
                                                   (g, out_f))):
                key = f"{base}.{suffix}"
                if key not in found:
                    raise AwqCheckpointError(
                        f"{folder}: tensor '{base}.qweight' is there but '{key}' is missing; "
                        "an AWQ projection needs qweight, qzeros and scales"
                    )
                _expect(key, found[key][1], want, found[key][0])
                parts[suffix] = get(key)
            weights[name] = Int4Weight.from_awq(parts["qweight"], parts["qzeros"],
                                                parts["scales"])
        elif name in found:
            _expect(name, found[name][1], dims, found[name][0])
            weights[name] = get(name).to(dtype)
        elif not (name == "lm_head.weight" and shape.tie_word_embeddings):
            raise AwqCheckpointError(
                f"{folder}: tensor '{name}' (or its AWQ form '{base}.qweight') is in no "
                "safetensors file; the config's model needs it"
            )
    return shape, weights
