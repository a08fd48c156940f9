"""Weight-only quantization math in plain torch (runs on the CPU): int8 and AWQ-style int4.

Two formats, both for a linear weight W [out, in] (torch's layout, y = x @ W.T):

* **int8, per output channel, symmetric**: q = round(W / s) in [-127, 127], s = max|W_row| / 127
  (fp32, one per output row). W ~= q * s.
* **int4, group-wise, asymmetric (AWQ)**: along `in`, groups of 128; per (group, output column)
  a scale s and an integer zero point z in [0, 15]; q = clamp(round(W / s) + z, 0, 15) and
  W ~= (q - z) * s. s = (max - min) / 15 over the group, z = round(-min / s).

AWQ's file layout (autoawq's GEMM format) stores the *transposed* weight:
  qweight int32 [in, out/8], qzeros int32 [in/128, out/8], scales fp16 [in/128, out].
Eight 4-bit values share an int32; nibble i (bits 4i..4i+3) of word c holds column
8c + AWQ_ORDER[i], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7). The interleave lets a kernel turn
the masks 0x000F000F, >>4, >>8, >>12 of one word into pairs of adjacent columns.

The GPU kernel (kernels/gemv_int4.cu) reads the weight row-major instead, "kernel layout":
  qweight_t int32 [out, in/8], nibble i of word j holds input index 8j + AWQ_ORDER[i]
(the same interleave, along `in`), with AWQ's qzeros and scales unchanged. `awq_to_kernel` /
`kernel_to_awq` convert; the file format stays AWQ.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds element AWQ_ORDER[i] of its 8
GROUP_SIZE = 128
INT8_MAX = 127
INT4_MAX = 15


# -- int8 per output channel ------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (q int8 [out, in], scales fp32 [out]), symmetric."""
    wf = w.float()
    amax = wf.abs().amax(dim=-1)  # [out]
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))  # [out]
    q = torch.round(wf / scales[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q int8 [..., out, in], scales [..., out] -> W [..., out, in] in `dtype`."""
    return (q.float() * scales.float()[..., None]).to(dtype)


def int8_matmul_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Reference y = x @ dequant(q, scales).T in fp32, returned in x.dtype. x [..., in]."""
    return (x.float() @ dequantize_int8(q, scales).T).to(x.dtype)


# -- int4 group-wise (AWQ) --------------------------------------------------------------------
def int4_fits(out_features: int, in_features: int, group: int = GROUP_SIZE) -> bool:
    """True when a weight [out, in] can take int4: whole groups along `in`, and `out` a
    multiple of 8 (eight 4-bit columns share an int32)."""
    return in_features % group == 0 and out_features % 8 == 0


def _check_int4_shape(out_features: int, in_features: int, group: int) -> None:
    if not int4_fits(out_features, in_features, group):
        raise ValueError(
            f"int4 quantization needs in_features % {group} == 0 and out_features % 8 == 0; "
            f"got a weight of shape [{out_features}, {in_features}]"
        )


def quantize_int4(
    w: torch.Tensor, group: int = GROUP_SIZE, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8 [in, out] in 0..15, zeros uint8 [in/g, out], scales [in/g, out]).

    Values are in AWQ's transposed orientation, not yet packed. The scale is rounded to
    `scale_dtype` (fp16, as AWQ files store it) *before* q and z are computed from it.
    """
    n_out, n_in = w.shape
    _check_int4_shape(n_out, n_in, group)
    wg = w.float().T.reshape(n_in // group, group, n_out)  # [G, g, out]
    wmax, wmin = wg.amax(dim=1), wg.amin(dim=1)  # [G, out]
    scales = ((wmax - wmin).clamp(min=1e-5) / INT4_MAX).to(scale_dtype)  # [G, out]
    s = scales.float()
    zeros = torch.round(-wmin / s).clamp_(0, INT4_MAX)  # [G, out]
    q = torch.round(wg / s[:, None]) + zeros[:, None]  # [G, g, out]
    q = q.clamp_(0, INT4_MAX).reshape(n_in, n_out)
    return q.to(torch.uint8), zeros.to(torch.uint8), scales


def dequantize_int4_values(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    """Unpacked q [in, out], zeros / scales [in/g, out] -> W [out, in] (torch layout)."""
    group = q.shape[0] // zeros.shape[0]
    z = zeros.float().repeat_interleave(group, dim=0)  # [in, out]
    s = scales.float().repeat_interleave(group, dim=0)  # [in, out]
    return ((q.float() - z) * s).T.to(dtype)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit patterns -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """values [rows, cols] in 0..15 -> int32 [rows, cols/8], AWQ's nibble order along cols."""
    rows, cols = values.shape
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)  # [rows, cols/8, 8]
    words = torch.zeros(rows, cols // 8, dtype=torch.int64, device=values.device)
    for i, col in enumerate(AWQ_ORDER):
        words |= v[:, :, col] << (4 * i)
    return _to_int32(words)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] -> uint8 [rows, cols] in 0..15 (inverse of pack_awq)."""
    rows, n = words.shape
    out = torch.empty(rows, n, 8, dtype=torch.uint8, device=words.device)
    for i, col in enumerate(AWQ_ORDER):
        out[:, :, col] = ((words >> (4 * i)) & 0xF).to(torch.uint8)  # >> keeps low nibbles
    return out.reshape(rows, n * 8)


def quantize_awq(
    w: torch.Tensor, group: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> AWQ tensors (qweight int32 [in, out/8], qzeros int32 [in/g, out/8],
    scales fp16 [in/g, out])."""
    q, zeros, scales = quantize_int4(w, group)
    return pack_awq(q), pack_awq(zeros), scales


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    """AWQ tensors -> W [out, in] in `dtype`."""
    return dequantize_int4_values(unpack_awq(qweight), unpack_awq(qzeros), scales, dtype)


def awq_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Reference y = x @ dequant(AWQ).T in fp32, returned in x.dtype. x [..., in]."""
    return (x.float() @ dequantize_awq(qweight, qzeros, scales).T).to(x.dtype)


# -- kernel layout (row-major int4 for kernels/gemv_int4.cu) ----------------------------------
def awq_to_kernel(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ qweight int32 [in, out/8] -> kernel layout qweight_t int32 [out, in/8]."""
    return pack_awq(unpack_awq(qweight).T.contiguous())


def kernel_to_awq(qweight_t: torch.Tensor) -> torch.Tensor:
    """Kernel layout qweight_t int32 [out, in/8] -> AWQ qweight int32 [in, out/8]."""
    return pack_awq(unpack_awq(qweight_t).T.contiguous())


def dequantize_kernel_int4(
    qweight_t: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    """Kernel-layout int4 weight -> W [out, in] in `dtype` (no AWQ round trip)."""
    q = unpack_awq(qweight_t)  # [out, in]
    group = q.shape[1] // scales.shape[0]
    z = unpack_awq(qzeros).T.float().repeat_interleave(group, dim=1)  # [out, in]
    s = scales.T.float().repeat_interleave(group, dim=1)  # [out, in]
    return ((q.float() - z) * s).to(dtype)
