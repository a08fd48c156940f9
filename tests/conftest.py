"""Shared test set-up: tests under tests/gpu are marked `gpu` and skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

GPU_DIR = Path(__file__).resolve().parent / "gpu"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda_available()
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if GPU_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)
