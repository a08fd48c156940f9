"""Quantized weight objects that a backend can store in place of a bf16 weight tensor.

`Int8Weight` and `Int4Weight` stand for a linear weight W [..., out, in] (a leading expert
dimension is allowed). They behave like the tensor they replace where the runtime touches
weights, through torch's `__torch_function__` protocol:

* `torch.cat([...], dim=0)` (fusing q/k/v, gate/up rows) and `torch.stack` (experts) in
  kestrel_rt/packing.py, `w[e]` (one expert), `.to(device=...)`, `.contiguous()`;
* `F.linear(x, w)`: the torch reference, dequantize to x.dtype then matmul. So the torch
  backend's `linear` runs quantized weights unchanged; the cupy backend calls
  kestrel_rt/cuda/gemv.py, which picks the gemv kernels by `weight_kind`.

`quantize_weights(hf, mode)` replaces the projection weights of a Hugging Face weight dict
(before `Backend.load`) by int8 or int4 objects, MoE experts per expert or fused
(transformers 5's in-memory `mlp.experts.gate_up_proj` / `down_proj`, quantized expert by
expert); embeddings, norms, the MoE router and the lm_head stay in their dtype. kestrel_rt/awq.py loads pre-quantized AWQ checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel_rt import quant
from kestrel_rt.weights import FUSED_DOWN, FUSED_GATE_UP
from kestrel_sim.errors import KestrelError
from kestrel_sim.quant_spec import int4_last

QUANT_MODES = ("int8", "int4")
# HF names of the weights that quantize (the linear projections of attention and MLPs).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class QuantizedWeight:
    """Base: a weight W [..., out, in] held in a quantized format; tensors in `_fields`."""

    kind = ""  # "int8" / "int4": what weight_kind reports
    _fields: tuple[str, ...] = ()
    _cat_dims: tuple[int, ...] = ()  # per field, the dim that is `out` (for torch.cat dim 0)

    def __init__(self, *tensors: torch.Tensor, shape: tuple[int, ...]):
        for name, t in zip(self._fields, tensors):
            setattr(self, name, t)
        self.shape = torch.Size(shape)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f) for f in self._fields]

    def _new(self, tensors, shape):
        return type(self)(*tensors, shape=tuple(shape))

    @property
    def device(self) -> torch.device:
        return self.tensors()[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dim(self) -> int:
        return len(self.shape)

    def to(self, device=None, dtype=None, **_):
        """Move to `device`; `dtype` names the activations' dtype and changes nothing here."""
        if device is None:
            return self
        return self._new([t.to(device) for t in self.tensors()], self.shape)

    def contiguous(self):
        return self._new([t.contiguous() for t in self.tensors()], self.shape)

    def __getitem__(self, index: int):
        """One expert of a stacked [E, out, in] weight."""
        if self.dim() != 3 or not isinstance(index, int):
            raise TypeError(f"{type(self).__name__} supports only w[expert] on [E, out, in]")
        return self._new([t[index] for t in self.tensors()], self.shape[1:])

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """Reference: x [..., in] @ dequantize(x.dtype).T -> [..., out]."""
        return F.linear(x, self.dequantize(x.dtype))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            if kwargs.get("bias", args[2] if len(args) > 2 else None) is not None:
                return NotImplemented
            return w.linear(x)
        if func in (torch.cat, torch.stack):
            parts = list(args[0])
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if not all(isinstance(p, cls) for p in parts):
                return NotImplemented
            return cls._join(parts, dim, stack=func is torch.stack)
        return NotImplemented

    @classmethod
    def _join(cls, parts, dim: int, stack: bool):
        first = parts[0]
        if stack:
            if dim != 0:
                return NotImplemented
            tensors = [torch.stack(ts) for ts in zip(*(p.tensors() for p in parts))]
            return first._new(tensors, (len(parts), *first.shape))
        if dim not in (0, -first.dim()) or first.dim() != 2:
            return NotImplemented  # only fusing output rows of 2-D weights
        tensors = [torch.cat(ts, dim=d) for ts, d in
                   zip(zip(*(p.tensors() for p in parts)), cls._cat_dims)]
        rows = sum(p.shape[0] for p in parts)
        return first._new(tensors, (rows, first.shape[1]))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, device={self.device})"


class Int8Weight(QuantizedWeight):
    """q int8 [..., out, in], scales fp32 [..., out]: W = q * scales."""

    kind = "int8"
    _fields = ("q", "scales")
    _cat_dims = (0, 0)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int8Weight:
        q, s = quant.quantize_int8(w)
        return cls(q, s, shape=tuple(w.shape))

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return quant.dequantize_int8(self.q, self.scales, dtype)


class Int4Weight(QuantizedWeight):
    """AWQ-style int4, group 128, in the kernel layout (kestrel_rt/quant.py):
    qweight_t int32 [..., out, in/8], qzeros int32 [..., in/128, out/8], scales fp16
    [..., in/128, out]. W = (q - zero) * scale per (group of 128 inputs, output row)."""

    kind = "int4"
    _fields = ("qweight_t", "qzeros", "scales")
    _cat_dims = (0, 1, 1)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int4Weight:
        qweight, qzeros, scales = quant.quantize_awq(w)
        return cls.from_awq(qweight, qzeros, scales)

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
        """From AWQ file tensors (qweight [in, out/8], qzeros [in/128, out/8], scales)."""
        n_in, n_out = qweight.shape[0], qweight.shape[1] * 8
        return cls(quant.awq_to_kernel(qweight), qzeros.to(torch.int32),
                   scales.to(torch.float16), shape=(n_out, n_in))

    def to_awq(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qweight [in, out/8], qzeros, scales) as an AWQ file stores them (2-D only)."""
        return quant.kernel_to_awq(self.qweight_t), self.qzeros, self.scales

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        if self.dim() == 3:
            return torch.stack([self[e].dequantize(dtype) for e in range(self.shape[0])])
        return quant.dequantize_kernel_int4(self.qweight_t, self.qzeros, self.scales, dtype)


def weight_kind(w) -> str:
    """What a stored weight is: "int8" / "int4" (a QuantizedWeight), else its tensor's dtype
    name ("bf16", "float32", ...). The one place a weight's format is looked up."""
    kind = getattr(w, "kind", None)
    if kind:
        return kind
    return "bf16" if w.dtype == torch.bfloat16 else str(w.dtype).removeprefix("torch.")


def quantize_weight(w: torch.Tensor, mode: str) -> QuantizedWeight:
    """One weight [out, in] as an int8 or int4 object on w's device."""
    if mode == "int8":
        return Int8Weight.from_float(w)
    if mode == "int4":
        return Int4Weight.from_float(w)
    raise KestrelError(f"quantization '{mode}' is not supported: expected one of "
                       f"{', '.join(QUANT_MODES)}")


def is_projection(name: str) -> bool:
    """True for the HF names of linear projections that quantize (not embed/norm/router/head)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in PROJECTIONS


def is_fused_experts(name: str) -> bool:
    """True for transformers 5's fused MoE expert weights (`mlp.experts.gate_up_proj`
    [E, 2I, H], `mlp.experts.down_proj` [E, H, I]; names without `.weight`)."""
    return name.endswith((FUSED_GATE_UP, FUSED_DOWN))


def check_quantizable(name: str, w: torch.Tensor, mode: str) -> None:
    """A KestrelError naming the tensor when its shape cannot take `mode`."""
    out_f, in_f = w.shape[-2], w.shape[-1]
    if mode == "int4" and not quant.int4_fits(out_f, in_f):
        raise KestrelError(
            f"tensor '{name}' of shape {list(w.shape)} cannot be quantized to int4: expected "
            f"in_features a multiple of {quant.GROUP_SIZE} and out_features a multiple of 8"
        )


# The `mode` spellings of "keep the float weights" (the CLI's --quant default is "none")
UNQUANTIZED = (None, "none", "bf16")


def check_mode(mode: str | None, layers: int | None = None) -> None:
    """A KestrelError unless `mode` is unquantized, int8, int4 or int4-last-N (N <= layers)."""
    if mode in UNQUANTIZED or mode in QUANT_MODES:
        return
    n = int4_last(mode)  # a mixed mode: a quantized copy of a small model that still agrees
    if n is None:        # with it (kestrel_rt/spec/organic.py)
        raise KestrelError(f"quantization '{mode}' is not supported: expected one of "
                           f"{', '.join(QUANT_MODES)}, int4-last-N (int4 in the last N layers, "
                           "int8 in the others), or none for bf16")
    if layers is not None and n > layers:
        raise KestrelError(f"quantization '{mode}': the model has {layers} layers")


def layer_of(name: str) -> int | None:
    """The layer index of a Hugging Face weight name (model.layers.{i}....), else None."""
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def mode_of(name: str, mode: str, layers: int | None) -> str:
    """The quantization of weight `name` under `mode` (int4-last-N: by its layer)."""
    n = int4_last(mode)
    if n is None:
        return mode
    layer = layer_of(name)
    return "int4" if layers is not None and layer is not None and layer >= layers - n else "int8"


def quantize_weights(hf: dict, mode: str | None, layers: int | None = None) -> dict:
    """Replace, in place, every projection weight of `hf` by its `mode` object; returns hf.

    Tensors are converted one at a time and the bf16 original dropped, so peak memory is
    the model plus one tensor. `mode` None or "none" leaves hf unchanged; int4-last-N needs
    the model's number of `layers`.
    """
    if mode in UNQUANTIZED:
        return hf
    check_mode(mode, layers)
    for name in [n for n in hf if is_projection(n) or is_fused_experts(n)]:
        w = hf[name]
        if isinstance(w, QuantizedWeight):
            continue
        kind = mode_of(name, mode, layers)
        check_quantizable(name, w, kind)
        if w.dim() == 3:  # fused experts [E, out, in]: each expert as its own weight
            hf[name] = torch.stack([quantize_weight(w[e], kind) for e in range(w.shape[0])])
        else:
            hf[name] = quantize_weight(w, kind)
    return hf
