"""Fixtures of the kernel tests: one KernelModules and the SM count per test module."""

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
