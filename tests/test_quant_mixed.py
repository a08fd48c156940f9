"""quantize_weights' mixed mode int4-last-N: int4 in the last N layers, int8 elsewhere."""

from __future__ import annotations

import pytest
import torch

from kestrel_rt.quant_weights import quantize_weights, weight_kind
from kestrel_sim.errors import KestrelError


def _weights(layers: int) -> dict:
    g = torch.Generator().manual_seed(0)
    hf = {"model.embed_tokens.weight": torch.randn(64, 128, generator=g)}
    for i in range(layers):
        hf[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(128, 128, generator=g)
        hf[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(128, 256, generator=g)
        hf[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(128)
    return hf


@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_the_last_n_layers_are_int4_and_the_rest_int8(n):
    hf = quantize_weights(_weights(4), f"int4-last-{n}", layers=4)
    for name, w in hf.items():
        if name.endswith("_proj.weight"):
            layer = int(name.split(".")[2])
            assert weight_kind(w) == ("int4" if layer >= 4 - n else "int8"), name
        else:
            assert isinstance(w, torch.Tensor) and w.dtype == torch.float32, name


@pytest.mark.parametrize("mode", ["int4-last-5", "int4-last-x", "int3", "int4-first-2"])
def test_bad_modes_are_refused(mode):
    with pytest.raises(KestrelError, match="quantization"):
        quantize_weights(_weights(4), mode, layers=4)
