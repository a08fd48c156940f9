"""packing.next_matmuls against the order Qwen3Model.compute really multiplies in: the bulk
gemv's L2 look-ahead (CupyBackend._ahead, Gemv.ahead_args) prefetches the weight it names."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.model import Qwen3Model
from kestrel_rt.packing import next_matmuls


class Recording(TorchBackend):
    """TorchBackend that notes each matmul's weight name, and "moe" for a MoE block."""

    def __init__(self) -> None:
        super().__init__("cpu", torch.float32)
        self.names: list[str] = []

    def linear(self, x, name):
        self.names.append(name)
        return super().linear(x, name)

    def moe(self, x, layer):
        self.names.append("moe")
        return super().moe(x, layer)


@pytest.mark.parametrize("name", ["untied", "tied", "moe_norm"])
def test_next_matmuls_is_the_forward_order(name):
    ref = tm.in_memory(name, seed=1)
    shape = tm.shape_of(ref.config)
    be = Recording()
    model = Qwen3Model(shape, tm.weights_of(ref), be)
    model.allocate_kv(1, 16)
    model.forward(torch.tensor([[3, 5, 7]]), [0])
    model.forward(torch.tensor([[11]]), [0])  # a decode step: lm_head -> layer 0's qkv
    seen = {(a, b) for a, b in zip(be.names, be.names[1:]) if "moe" not in (a, b)}
    expected = next_matmuls(shape)
    assert set(expected.items()) == seen
    assert expected["lm_head"] == "layers.0.qkv"
    assert all(be.weight(b) is not None for b in expected.values())
    moe_layers = [i for i in range(shape.num_hidden_layers) if shape.is_moe_layer(i)]
    assert (name == "moe_norm") == bool(moe_layers)
    for i in moe_layers:  # nothing prefetched across a MoE block
        assert f"layers.{i}.o" not in expected
        assert f"layers.{i + 1}.qkv" not in expected.values()
