"""Building the serving engine's model instances, through the runtime's one builder
(kestrel_rt/runner.py: a GraphModel on the cupy backend on a GPU, Qwen3Model on the torch
backend elsewhere, with the device's default options).

Every call builds a new instance with its own backend (a disaggregated run has a target per
worker); dummy weights are seeded, so instances of one preset hold the same weights.
"""

from __future__ import annotations

import torch

from kestrel_rt.model import Qwen3Model
from kestrel_rt.runner import build_model as build_runner


def build_model(name_or_folder: str, device: str | torch.device,
                dtype: str | torch.dtype | None = None, quant: str = "none") -> Qwen3Model:
    """A ready model of a preset (dummy weights, seed 0) or a Hugging Face folder, its
    projections quantized as `quant` says (a scenario's quant / draft.quant)."""
    return build_runner(name_or_folder, device, dtype, quant, seed=0)
