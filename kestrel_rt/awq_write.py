"""Write an AWQ checkpoint from a bf16 / fp32 folder (for tests, and for making a quantized
checkpoint without autoawq). kestrel_rt/awq.py says what the format is and loads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kestrel_rt import quant
from kestrel_rt.loading import load_folder
from kestrel_rt.quant_weights import check_quantizable, is_projection


def write_awq_folder(src: str | Path, dst: str | Path) -> Path:
    """Quantize the projections of the bf16/fp32 folder `src` to AWQ int4 into `dst`.

    Copies config.json (adding quantization_config) and tokenizer files; writes one
    model.safetensors. Returns dst.
    """
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    _, weights = load_folder(src, "cpu", "float32")
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if is_projection(name):
            check_quantizable(name, w, "int4")
            qweight, qzeros, scales = quant.quantize_awq(w)
            base = name.removesuffix(".weight")
            out.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros,
                        f"{base}.scales": scales})
        else:
            out[name] = w.to(torch.float16).contiguous()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4,
                                     "group_size": quant.GROUP_SIZE, "zero_point": True,
                                     "version": "gemm"}
    config["torch_dtype"] = "float16"
    config.pop("dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("vocab.json", "merges.txt"):
            shutil.copy(f, dst / f.name)
    return dst
