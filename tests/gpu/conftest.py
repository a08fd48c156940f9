"""Fixtures of the kernel tests: one KernelModules and the SM count per test module, and a
record of the gemv plans a test made."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def km():
    from kestrel_rt.cuda.module import KernelModules

    return KernelModules(torch.device("cuda"))


@pytest.fixture(scope="module")
def sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


@pytest.fixture
def gemv_plans(monkeypatch) -> list:
    """(pro, rows, Plan) of every gemv launch the dispatch table (kestrel_rt/cuda/gemv_plan.py)
    planned during the test, by any Gemv: each Gemv.matmul that forces no kernel (linear,
    fused, the expert router) and each Gemv.takes_argmax. A CUDA graph's replays plan
    nothing (only its eager run and its capture do)."""
    from kestrel_rt.cuda.gemv import Gemv

    plans: list = []
    real = Gemv.plan

    def recorded(self, w, pro, rows, k, matmul=None):
        chosen = real(self, w, pro, rows, k, matmul)
        plans.append((pro, rows, chosen))
        return chosen

    monkeypatch.setattr(Gemv, "plan", recorded)
    return plans
