"""The weight set of a Qwen3 model: which tensors it has, and random ones for dummy loads.

A weight set is a plain `dict[str, torch.Tensor]` keyed by the Hugging Face on-disk names
(`model.layers.3.self_attn.q_proj.weight`, `model.layers.0.mlp.experts.7.up_proj.weight`, ...),
so a checkpoint folder and a dummy load hand the model exactly the same thing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kestrel_sim.errors import KestrelError
from kestrel_sim.models import ModelShape, preset

if TYPE_CHECKING:
    import torch

DTYPES = ("bfloat16", "float16", "float32")
DUMMY_STD = 0.02  # std of random projection / embedding weights (transformers' init range)
DUMMY_NORM_STD = 0.02  # norm weights are 1 + noise of this std


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' | 'float16' | 'float32' (or a torch.dtype) as a torch.dtype."""
    import torch

    if isinstance(name, torch.dtype):
        if name in (torch.bfloat16, torch.float16, torch.float32):
            return name
        name = str(name).removeprefix("torch.")
    if name not in DTYPES:
        raise KestrelError(f"dtype '{name}' is not supported: expected one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def parse_device(name: str | torch.device) -> torch.device:
    """A torch.device, refusing CUDA where torch sees no CUDA device."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise KestrelError(
            f"device '{name}' is not a device: expected cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise KestrelError(
                f"device '{name}' asked for, but torch {torch.__version__} sees no CUDA device "
                "(a CPU-only build, or no GPU on this machine); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise KestrelError(
                f"device '{name}' does not exist: this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    elif device.type != "cpu":
        raise KestrelError(f"device '{name}' is not supported: expected cpu or cuda")
    return device


def expected_tensors(
    shape: ModelShape, fused_experts: bool = False
) -> dict[str, tuple[int, ...]]:
    """Every tensor of `shape`'s checkpoint, by its Hugging Face on-disk name, with its shape.

    MoE experts are per expert (`mlp.experts.{e}.gate_proj.weight`, ..., as Qwen3-MoE
    releases store them), or with `fused_experts` in transformers 5's fused form
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), which
    `save_pretrained(..., save_original_format=False)` writes.
    """
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "self_attn.q_norm.weight"] = (d,)
        out[p + "self_attn.k_norm.weight"] = (d,)
        if shape.is_moe_layer(i):
            m = shape.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (shape.num_experts, h)
            if fused_experts:
                out[p + "mlp.experts.gate_up_proj"] = (shape.num_experts, 2 * m, h)
                out[p + "mlp.experts.down_proj"] = (shape.num_experts, h, m)
            else:
                for e in range(shape.num_experts):
                    out[p + f"mlp.experts.{e}.gate_proj.weight"] = (m, h)
                    out[p + f"mlp.experts.{e}.up_proj.weight"] = (m, h)
                    out[p + f"mlp.experts.{e}.down_proj.weight"] = (h, m)
        else:
            m = shape.intermediate_size
            out[p + "mlp.gate_proj.weight"] = (m, h)
            out[p + "mlp.up_proj.weight"] = (m, h)
            out[p + "mlp.down_proj.weight"] = (h, m)
    out["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    return out


FUSED_GATE_UP = ".mlp.experts.gate_up_proj"  # [E, 2I, H]: gate rows then up rows, per expert
FUSED_DOWN = ".mlp.experts.down_proj"  # [E, H, I]


def has_fused_experts(names) -> bool:
    """True when MoE experts among `names` are fused (transformers 5's in-memory form)."""
    return any(name.endswith(FUSED_GATE_UP) for name in names)


def split_fused_experts(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace, in place, fused MoE experts (transformers 5's form) by per-expert entries.

    `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] and `...down_proj` [E, H, I]
    become `...experts.{e}.gate_proj.weight` [I, H], `up_proj.weight` [I, H] and
    `down_proj.weight` [H, I] (views, no copies). Returns hf.
    """
    for name in [n for n in hf if n.endswith(FUSED_GATE_UP)]:
        prefix = name.removesuffix(FUSED_GATE_UP)
        if prefix + FUSED_DOWN not in hf:
            raise KestrelError(
                f"tensor '{name}' (fused experts) is there but '{prefix + FUSED_DOWN}' is "
                "missing; fused MoE experts need both"
            )
        gate_up, down = hf.pop(name), hf.pop(prefix + FUSED_DOWN)  # [E, 2I, H], [E, H, I]
        m = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            q = f"{prefix}.mlp.experts.{e}"
            hf[f"{q}.gate_proj.weight"] = gate_up[e, :m]  # [I, H]
            hf[f"{q}.up_proj.weight"] = gate_up[e, m:]  # [I, H]
            hf[f"{q}.down_proj.weight"] = down[e]  # [H, I]
    return hf


def is_norm(name: str) -> bool:
    """True for RMSNorm weights (vectors that multiply, so they start near 1)."""
    return name.endswith(("norm.weight", "layernorm.weight"))


def dummy_weights(
    shape: ModelShape, device: str | torch.device, dtype: str | torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random weights of `shape`, made directly on `device` (no host copy of the model).

    Each tensor is allocated with torch.empty on the device and filled in place by a
    generator on that device: projections and embeddings N(0, 0.02), norms N(1, 0.02).
    Deterministic for (seed, device, dtype).
    """
    import torch

    device, dtype = parse_device(device), parse_dtype(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, dims in expected_tensors(shape).items():
        t = torch.empty(dims, device=device, dtype=dtype)
        if is_norm(name):
            t.normal_(1.0, DUMMY_NORM_STD, generator=gen)
        else:
            t.normal_(0.0, DUMMY_STD, generator=gen)
        weights[name] = t
    return weights


def load_dummy(
    preset_name: str, device: str | torch.device, dtype: str | torch.dtype, seed: int = 0
) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """The preset called `preset_name` and random weights of its real shapes on `device`.

    An unknown name raises UnknownPresetError listing the known presets.
    """
    shape = preset(preset_name)
    return shape, dummy_weights(shape, device, dtype, seed)


def weight_bytes(shape: ModelShape, dtype: str | torch.dtype) -> int:
    """Bytes the weight set of `shape` takes in `dtype`."""
    import math

    size = parse_dtype(dtype).itemsize
    return size * sum(math.prod(dims) for dims in expected_tensors(shape).values())

