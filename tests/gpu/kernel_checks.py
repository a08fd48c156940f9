"""What the kernel tests share: fresh random inputs, NaN-poisoned outputs, the error check.

Fresh random inputs for every call (a new seed each time); outputs go into a poisoned buffer
(every element must be written); relative error ||out - ref|| / ||ref|| <= 1e-5 in fp32 and
<= 1e-2 with bf16 operands; NaN never passes.
"""

from __future__ import annotations

import itertools

import torch

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EPS = 1e-6

_seed = itertools.count(10_000)


def generator() -> torch.Generator:
    """A CUDA generator with a seed no other call got."""
    return torch.Generator(device="cuda").manual_seed(next(_seed))


def rnd(*shape, dtype=torch.float32, scale=1.0):
    """Fresh N(0, scale^2) values on the GPU (a new seed every call)."""
    return (torch.randn(*shape, generator=generator(), device="cuda") * scale).to(dtype)


def poisoned(*shape, dtype):
    """An output buffer no valid result can be: NaN (integers: -7)."""
    if dtype in (torch.long, torch.int32):
        return torch.full(shape, -7, dtype=dtype, device="cuda")
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def check(out, ref, dtype):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output: an element not written, or a NaN"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"
