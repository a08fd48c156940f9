"""The MoE block's grouped path (kestrel_rt/moe.py grouped_experts_forward): the same sum as
the per-expert loop, with no host sync, whichever experts the tokens pick."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_rt import moe


def block(n: int, experts: int, k: int, dtype, seed: int = 0, hidden: int = 32, inter: int = 24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)  # [N, H]
    router = torch.randn(experts, hidden, generator=g).to(dtype)  # [E, H]
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / 6).to(dtype)  # [E, 2I, H]
    down = (torch.randn(experts, hidden, inter, generator=g) / 5).to(dtype)  # [E, H, I]
    weights, chosen = moe.route(x, router, k, True)  # [N, k] each
    return x, weights, chosen, gate_up, down


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), experts=st.integers(1, 12), k=st.integers(1, 4),
       seed=st.integers(0, 10_000))
def test_grouped_equals_the_per_expert_loop(n, experts, k, seed):
    k = min(k, experts)
    x, w, chosen, gate_up, down = block(n, experts, k, torch.float32, seed)
    got = moe.grouped_experts_forward(x, w, chosen, gate_up, down)
    want = moe.experts_forward(x, w, chosen, gate_up, down)
    assert got.shape == want.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_experts_no_token_picks_are_skipped_and_bf16_rounds_as_the_loop():
    x, w, chosen, gate_up, down = block(9, 16, 3, torch.bfloat16)
    chosen = torch.where(chosen < 8, chosen, chosen % 4)  # experts 8..15: no tokens at all
    got = moe.grouped_experts_forward(x, w, chosen, gate_up, down)
    loop = moe.experts_forward(x, w, chosen, gate_up, down)
    # the same products and the same adds in the same order: at most a matmul's last bit
    ulp = loop.abs().float().clamp_min(1e-3) * 2 ** -7
    assert ((got.float() - loop.float()).abs() <= ulp).all()


def test_the_path_is_chosen_by_what_the_grouped_matmul_takes():
    x, w, chosen, gate_up, down = block(5, 4, 2, torch.float32)
    assert moe.grouped_ok(x, gate_up, down)
    assert not moe.grouped_ok(x, gate_up.double(), down.double())  # mixed dtypes

    class Packed(torch.Tensor):  # a weight in a stored format (as quantized experts are)
        pass

    assert not moe.grouped_ok(x, gate_up.as_subclass(Packed), down)
    torch.testing.assert_close(moe.experts(x, w, chosen, gate_up, down),
                               moe.experts_forward(x, w, chosen, gate_up, down))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_bf16_goes_grouped_where_the_device_has_the_kernel():
    x, _, _, gate_up, down = block(5, 4, 2, torch.bfloat16)
    x, gate_up, down = x.cuda(), gate_up.cuda(), down.cuda()
    major = torch.cuda.get_device_capability()[0]
    assert moe.grouped_ok(x, gate_up, down) == (major >= 9)
    assert not moe.grouped_ok(x.float(), gate_up.float(), down.float())
