"""Tiny target / draft pairs for the speculative decoder's tests (CPU, fp32).

Every model gets its own TorchBackend and its own copy of the weights. Drafts of a target:
the same weights (accepts everything), the same weights with relative noise (agrees part of
the time: ~0.9 at 0.03, ~0.5 at 0.1 for the first position with "untied"), and another
random model (almost never agrees).
"""

from __future__ import annotations

import tiny_models as tm
import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.model import Qwen3Model

DRAFTS = ("same", "noisy0.03", "noisy0.1", "other")


def weights(name: str = "untied", seed: int = 0):
    """(shape, HF-named weights) of tiny config `name`."""
    ref = tm.in_memory(name, seed)
    return tm.shape_of(ref.config), tm.weights_of(ref)


def model(shape, hf: dict[str, torch.Tensor]) -> Qwen3Model:
    """A Qwen3Model on its own CPU fp32 backend, over copies of `hf`."""
    return Qwen3Model(shape, {k: v.clone() for k, v in hf.items()},
                      TorchBackend("cpu", torch.float32))


def noisy(hf: dict[str, torch.Tensor], scale: float, seed: int = 5) -> dict[str, torch.Tensor]:
    """Each tensor plus Gaussian noise of `scale` times its own std."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) for k, v in hf.items()}


def draft(kind: str, shape, hf: dict[str, torch.Tensor], name: str = "untied") -> Qwen3Model:
    """A draft of the target (shape, hf): one of DRAFTS."""
    if kind == "same":
        return model(shape, hf)
    if kind.startswith("noisy"):
        return model(shape, noisy(hf, float(kind.removeprefix("noisy"))))
    if kind == "other":
        return model(*weights(name, seed=1))
    raise ValueError(kind)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
