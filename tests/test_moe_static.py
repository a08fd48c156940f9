"""The capture-safe MoE experts (kestrel_rt/moe.py static_experts_forward) and the option
that puts a MoE prefill on them (RuntimeOptions.moe_prefill_graphs): the same sum as today's
MoE layer, shapes that do not depend on the routing, and nothing changed with the option off.
The CUDA-graph replay itself: tests/gpu/test_moe_prefill_graphs.py."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from test_moe_grouped import block
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from kestrel_rt import moe
from kestrel_rt.backend import TorchBackend
from kestrel_rt.backend.cupy_backend import CupyBackend
from kestrel_rt.options import OptionsError, RuntimeOptions, default_options
from kestrel_sim.models import preset

TOKENS = (1, 2, 7, 65, 130)  # 1 and 2 tokens leave most of the 6 tiny experts without rows


def loop_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's 2-D x 3-D contract as a loop (reads offs on the host): rows
    offs[e-1]:offs[e] of a [R, K] times b[e] [K, J] -> [R, J]."""
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[e]
        start = end
    assert start == a.shape[0]  # the groups cover every row
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", TOKENS)
def test_static_equals_the_grouped_path_bit_for_bit(n, dtype):
    x, w, chosen, gate_up, down = block(n, 8, 3, dtype, seed=n)
    want = moe.grouped_experts_forward(x, w, chosen, gate_up, down)
    got = moe.static_experts_forward(x, w, chosen, gate_up, down)
    assert torch.equal(got, want)
    # the routing, offsets and combine alone, through a grouped matmul written as a loop
    looped = moe.static_experts_forward(x, w, chosen, gate_up, down, loop_grouped_mm)
    torch.testing.assert_close(looped, moe.experts_forward(x, w, chosen, gate_up, down),
                               rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)


def test_experts_nobody_picked_are_empty_groups():
    x, w, _, gate_up, down = block(9, 16, 3, torch.float32)
    g = torch.Generator().manual_seed(1)
    chosen = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(9)])  # [9, 3]
    # experts 6..15: no rows at all (and 0..5 empty too where no token drew them)
    got = moe.static_experts_forward(x, w, chosen, gate_up, down, loop_grouped_mm)
    torch.testing.assert_close(got, moe.experts_forward(x, w, chosen, gate_up, down),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(got, moe.static_experts_forward(x, w, chosen, gate_up, down))


def _fake_call(fn, tensors):
    """fn(*tensors) on fake tensors: no data, so an op that reads a value on the host or
    makes a shape from the data raises."""
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in tensors]
    with mode:
        return fn(*fakes)


def test_static_path_reads_no_device_value_and_has_fixed_shapes():
    tensors = block(40, 8, 3, torch.bfloat16)
    out = _fake_call(moe.static_experts_forward, tensors)
    assert out.shape == (40, 32) and out.dtype == torch.bfloat16
    with pytest.raises(DynamicOutputShapeException):  # the control: the loop picks on the host
        _fake_call(moe.experts_forward, tensors)


def test_static_path_takes_qwen3_30b_a3b_prefill_shapes():
    """A 2048-token chunk at the preset's real shapes (fake tensors: no memory), through the
    grouped matmul's own shape and layout checks."""
    s = preset("qwen3-30b-a3b")
    E, H, inter, k, n = (s.num_experts, s.hidden_size, s.moe_intermediate_size,
                         s.num_experts_per_tok, 2048)
    with FakeTensorMode():
        bf = {"dtype": torch.bfloat16}
        x = torch.empty(n, H, **bf)
        w, chosen = moe.route(x, torch.empty(E, H, **bf), k, s.norm_topk_prob)
        out = moe.static_experts_forward(x, w, chosen, torch.empty(E, 2 * inter, H, **bf),
                                         torch.empty(E, H, inter, **bf))
    assert out.shape == (n, H) and out.dtype == torch.bfloat16


# -- the option, on the cupy backend's MoE fallback and its graph gate ----------------------
def _cupy_on_cpu(name: str, **options) -> CupyBackend:
    """A CupyBackend over tiny model `name`'s bf16 weights, built without CUDA (no kernels,
    no gemv): only what its MoE fallback and its graph gate read."""
    ref = tm.in_memory(name, seed=3)
    be = object.__new__(CupyBackend)
    TorchBackend.__init__(be, "cpu", torch.bfloat16)
    be.options = RuntimeOptions(backend="cupy", graphs=True, **options)
    be._unit_norms, be._graph_safe, be._static_moe = set(), {}, None
    TorchBackend.load(be, "m", tm.shape_of(ref.config), tm.weights_of(ref))
    return be


def _reference(name: str) -> TorchBackend:
    ref = tm.in_memory(name, seed=3)
    be = TorchBackend("cpu", torch.bfloat16)
    be.load("m", tm.shape_of(ref.config), tm.weights_of(ref))
    return be


@pytest.fixture
def static_calls(monkeypatch) -> list[int]:
    """The token count of every static_experts_forward call during the test."""
    calls: list[int] = []
    real = moe.static_experts_forward

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(moe, "static_experts_forward", counted)
    return calls


@pytest.mark.parametrize("name", sorted(tm.MOE_CONFIGS))
def test_option_gives_todays_moe_layer(name, static_calls):
    today = _reference(name)
    on, off = _cupy_on_cpu(name, moe_prefill_graphs=True), _cupy_on_cpu(name)
    s = today.shape
    empty_seen = False
    for layer in (i for i in range(s.num_hidden_layers) if s.is_moe_layer(i)):
        for n in TOKENS:
            g = torch.Generator().manual_seed(100 * layer + n)
            x = (torch.randn(n, s.hidden_size, generator=g) * 2).to(torch.bfloat16)  # [N, H]
            _, chosen = moe.route(x, today.weight(f"layers.{layer}.router"),
                                  s.num_experts_per_tok, s.norm_topk_prob)
            empty_seen |= chosen.unique().numel() < s.num_experts
            want = today.moe(x, layer)
            before = len(static_calls)
            assert torch.equal(TorchBackend.moe(on, x, layer), want)
            assert static_calls[before:] == [n]  # the option on: the static path ran
            assert torch.equal(TorchBackend.moe(off, x, layer), want)
            assert len(static_calls) == before + 1  # off: today's path, unchanged
    assert empty_seen


def test_option_opens_the_graph_gate_for_moe_prefill_only():
    on, off = _cupy_on_cpu("moe_norm", moe_prefill_graphs=True), _cupy_on_cpu("moe_norm")
    assert on.static_moe()
    for m in (32, 96, 2048):  # prefill chunk buckets
        assert on.graph_safe(1, m) and not off.graph_safe(1, m)
    dense = _cupy_on_cpu("untied")
    assert dense.graph_safe(1, 96)  # a dense prefill: graphed either way


def test_quantized_or_refused_experts_keep_the_gate_shut():
    be = _cupy_on_cpu("moe_norm", moe_prefill_graphs=True)

    class Packed(torch.Tensor):  # a weight in a stored format, as quantized experts are
        pass

    layer = next(i for i in range(be.shape.num_hidden_layers) if be.shape.is_moe_layer(i))
    key = be._key(f"layers.{layer}.experts.down")
    be._weights[key] = be._weights[key].as_subclass(Packed)
    assert not be.static_moe() and not be.graph_safe(1, 96)


def test_option_is_off_by_default_and_validated():
    assert not RuntimeOptions().moe_prefill_graphs
    assert not default_options("cpu", preset("qwen3-30b-a3b")).moe_prefill_graphs
    with pytest.raises(OptionsError, match="moe_prefill_graphs need backend 'cupy'"):
        default_options("cpu", moe_prefill_graphs=True)
    with pytest.raises(ValueError, match="needs graphs=True"):
        RuntimeOptions(backend="cupy", graphs=False, moe_prefill_graphs=True)
