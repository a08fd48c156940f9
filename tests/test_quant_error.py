"""kestrel_rt.quant_error: the logits error of a quantized model against its unquantized self."""

from __future__ import annotations

import math

import pytest
import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.model import Qwen3Model
from kestrel_rt.quant_error import logits_error
from kestrel_rt.quant_weights import quantize_weights
from kestrel_rt.weights import dummy_weights
from kestrel_sim.models import ModelShape

SHAPE = ModelShape(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, intermediate_size=512,
                   max_position_embeddings=64)


def _model(quant: str | None) -> Qwen3Model:
    weights = dummy_weights(SHAPE, "cpu", torch.float32, seed=3)
    quantize_weights(weights, quant)
    return Qwen3Model(SHAPE, weights, TorchBackend("cpu", torch.float32))


def test_same_weights_have_no_error():
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    err = logits_error(_model(None), _model(None), tokens)
    assert err["rel_error"] == 0 and err["max_abs"] == 0
    assert err["argmax_agreement"] == 1 and err["positions"] == 32


def test_int4_errs_more_than_int8():
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = _model(None)
    int8 = logits_error(ref, _model("int8"), tokens)
    int4 = logits_error(ref, _model("int4"), tokens)
    assert 0 < int8["rel_error"] < int4["rel_error"] < 1
    assert int8["argmax_agreement"] >= int4["argmax_agreement"]
    assert int8["max_abs"] > 0


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_error_is_finite(quant):
    tokens = torch.randint(0, SHAPE.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    err = logits_error(_model(None), _model(quant), tokens)
    assert all(math.isfinite(v) for v in err.values())
