"""Building the serving engine's model instances: one function, so that switching it to the
runtime's single builder (kestrel_rt/runner.py `build_model`: a GraphModel on the cupy
backend on a GPU, Qwen3Model on the torch backend elsewhere) is a one-line change.

Every call builds a new instance with its own backend (a disaggregated run has a target per
worker); dummy weights are seeded, so instances of one preset hold the same weights.
"""

from __future__ import annotations

import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.loading import default_dtype, load_folder, resolve
from kestrel_rt.model import Qwen3Model
from kestrel_rt.weights import load_dummy, parse_device, parse_dtype


def build_model(name_or_folder: str, device: str | torch.device,
                dtype: str | torch.dtype | None = None) -> Qwen3Model:
    """A ready model of a preset (seeded dummy weights) or a Hugging Face folder, on the
    torch backend. TODO(lead): kestrel_rt.runner.build_model here once it lands."""
    shape, folder = resolve(name_or_folder)
    dev = parse_device(str(device))
    dt = parse_dtype(dtype or default_dtype(folder, dev))
    if folder is not None:
        shape, weights = load_folder(folder, dev, dt)
    else:
        shape, weights = load_dummy(shape.name, dev, dt, seed=0)
    return Qwen3Model(shape, weights, TorchBackend(dev, dt))
