"""Attention wrappers: decode / verify attention over one layer's KV cache, on torch's stream.

Two kernels split the context over blocks (flash-decoding); each block writes its split's partial
softmax results to a workspace, and the last block of a (sequence, kv head[, row group]) to
finish merges them into the output (kernels/common.cuh: last_to_arrive, merge_rows), so
attention is one launch:
  * attn_decode (kernels/decode_attention.cu): one warp per key, for at most DECODE_MAX_ROWS
    query rows (M * Hq / Hkv) and head_dim in DECODE_HEAD_DIMS. It reads the step's new K/V
    from the projections and writes them into the cache itself; its `rope` variant also does
    the q/k RMSNorm + RoPE of qk_norm_rope (rope_attention).
  * attn_verify (kernels/verify_attention.cu): with RuntimeOptions.mma_verify, more rows than
    that (verify, M = k + 1 tokens), bf16, head_dim in VERIFY_HEAD_DIMS, on the tensor cores
    (compute capability 8.0+); after a kv_write launch.
  * attn_partial (kernels/attention_partial.cu): anything else, after a kv_write launch.

Like ops.py, each wrapper raises `Unsupported` when its kernel cannot take the inputs. Shapes
follow the Backend ops (kestrel_rt/backend/base.py); `km` is the backend's KernelModules.
"""

from __future__ import annotations

import functools
import math

import torch

from kestrel_rt.cuda.module import KernelModules, ensure_dynamic_shared, f32, i32, i64, ptr
from kestrel_rt.cuda.ops import (
    Unsupported,
    aligned,
    dest,
    dtype_suffix,
    round_up,
    token_rows,
    vec_elems,
)
from kestrel_rt.options import DECODE_MIN_KEYS

ATTN_THREADS = 256
ATTN_ELEMS = 4096  # rows-per-block * head_dim held in registers by one attn_partial block
DECODE_WARPS = 4  # warps of the warp-per-key decode kernel
DECODE_MAX_ROWS = 8  # query rows (M * Hq / Hkv) it takes; more go to attn_partial
DECODE_HEAD_DIMS = (64, 128, 256)  # head_dim = 32 lanes * 2, 4 or 8 elements
MAX_SPLITS = 64  # context splits (the merge holds one weight per split)
VERIFY_TILE = 64  # keys per tile of attn_verify (kernels/verify_attention.cu VERIFY_TILE)
VERIFY_PAD = 8  # elements of padding per shared row (VERIFY_PAD)
VERIFY_HEAD_DIMS = (64, 128)
VERIFY_MAX_ROWS = 64  # query rows per attn_verify block (4 m-tiles of 16); more: row groups
VERIFY_BLOCKS_PER_SM = 2  # its launch bounds' blocks per SM, what its splits aim at


def kv_write(km: KernelModules, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    """k, v [B, M, Hkv, D] -> k_cache, v_cache [slots, max_len, Hkv, D] at (slots[b],
    positions[b, m])."""
    sfx = dtype_suffix(k, v, k_cache, v_cache)
    B, M, Hkv, D = k.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise Unsupported("cache not contiguous")
    k, k_st = token_rows(k)
    v, v_st = token_rows(v)
    width = Hkv * D
    n = vec_elems(k.dtype)
    vec = (width % n == 0 and k_st % n == 0 and v_st % n == 0
           and aligned(k, v, k_cache, v_cache))
    threads = min(256, max(32, round_up(math.ceil(width / (n if vec else 1)), 32)))
    km.launch("attention_partial", f"kv_write_{sfx}", (B * M,), (threads,),
              (ptr(k), i64(k_st), ptr(v), i64(v_st), ptr(k_cache), ptr(v_cache),
               ptr(slots.contiguous()), ptr(positions.contiguous()), i32(M),
               i64(k_cache.stride(0)), i64(k_cache.stride(1)), i32(width), i32(int(vec))))


def attention_plan(B: int, M: int, Hq: int, Hkv: int, D: int, max_len: int,
                   num_sms: int) -> tuple[int, int, int, int, int]:
    """(rows per block, row groups, key tile, splits, threads per dot) for attn_partial.
    Depends only on shapes and the cache's max_len (not on current lengths), so a captured
    graph stays valid as sequences grow: each block sizes its slice of the context at run
    time."""
    rows = M * (Hq // Hkv)
    rb = max(1, min(rows, ATTN_ELEMS // D))
    groups = math.ceil(rows / rb)
    tile = 16 if D <= 128 else 8
    base = B * Hkv * groups
    splits = max(1, min(MAX_SPLITS, math.ceil(2 * num_sms / base), math.ceil(max_len / tile)))
    tpd = 1
    while tpd < 32 and rb * tile * tpd * 2 <= ATTN_THREADS:
        tpd *= 2
    return rb, groups, tile, splits, tpd


def verify_plan(B: int, M: int, Hq: int, Hkv: int, D: int, max_len: int,
                num_sms: int) -> tuple[int, int, int]:
    """(m-tiles of 16 rows per block, row groups, splits) for attn_verify. Static for a given
    cache, like attention_plan: each block sizes its slice of the context at run time."""
    rows = M * (Hq // Hkv)
    groups = math.ceil(rows / VERIFY_MAX_ROWS)
    mt = math.ceil(math.ceil(rows / groups) / 16)
    base = B * Hkv * groups
    splits = max(1, min(MAX_SPLITS, math.ceil(VERIFY_BLOCKS_PER_SM * num_sms / base),
                        math.ceil(max_len / VERIFY_TILE)))
    return mt, groups, splits


def verify_launch(mt: int, D: int) -> tuple[int, int]:
    """(threads, dynamic shared bytes) of attn_verify with mt m-tiles (VerifyShape): 4 warps
    per m-tile up to 2 m-tiles, else 2; Q [16 mt, D + pad] and two stages of K, V
    [VERIFY_TILE, D + pad], bf16."""
    warps = mt * (4 if mt <= 2 else 2)
    stride = D + VERIFY_PAD
    return 32 * warps, 2 * (16 * mt * stride + 2 * 2 * VERIFY_TILE * stride)


# Blocks per SM the warp-per-key kernel's context splits aim at. It waits on memory latency far
# more than on bandwidth, so more blocks help long contexts (docs/performance.md).
DECODE_BLOCKS_PER_SM = 4


def decode_splits(B: int, Hkv: int, max_len: int, num_sms: int) -> int:
    """Context splits of the warp-per-key kernel (static for a given cache, like the plan)."""
    return max(1, min(MAX_SPLITS, math.ceil(DECODE_BLOCKS_PER_SM * num_sms / (B * Hkv)),
                      math.ceil(max_len / (2 * DECODE_WARPS))))


def _partials(rows: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Workspace of per-split partial results: acc [rows, D] and (max, sum) [rows, 2], fp32."""
    return (torch.empty(rows * D, dtype=torch.float32, device=device),
            torch.empty(rows * 2, dtype=torch.float32, device=device))


def _tickets(km: KernelModules, n: int, device) -> torch.Tensor:
    """int32 [>= n] arrival tickets of the last-block merge, one per group of split blocks.
    Zero when made, and every launch leaves them zero; so they are made once per size (a power
    of two) and kept in `km.workspaces`: a captured CUDA graph holds their address."""
    key = ("attention_tickets", max(1024, 1 << (n - 1).bit_length()))
    if key not in km.workspaces:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"attention tickets for {n} groups first needed inside a CUDA "
                               "graph capture: run the same step once before capturing it")
        km.workspaces[key] = torch.zeros(key[1], dtype=torch.int32, device=device)
    return km.workspaces[key]


def _warp_kernel_takes(M: int, Hq: int, Hkv: int, D: int, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> bool:
    """True when attn_decode (one warp per key) takes these shapes."""
    return (Hq % Hkv == 0 and M * (Hq // Hkv) <= DECODE_MAX_ROWS and D in DECODE_HEAD_DIMS
            and k_cache.is_contiguous() and v_cache.is_contiguous())


@functools.cache
def _tensor_cores(device_index: int) -> bool:
    """bf16 mma.sync and cp.async: compute capability 8.0+."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def _verify_kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                         ) -> bool:
    """True when attn_verify (tensor cores) takes these shapes (the caller has ruled out
    attn_decode)."""
    Hq, D, Hkv = q.shape[2], q.shape[3], k_cache.shape[2]
    return (q.dtype == torch.bfloat16 and Hq % Hkv == 0 and D in VERIFY_HEAD_DIMS
            and k_cache.is_contiguous() and v_cache.is_contiguous() and aligned(k_cache, v_cache)
            and _tensor_cores(q.device.index if q.device.index is not None
                              else torch.cuda.current_device()))


def _verify(km: KernelModules, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            slots: torch.Tensor, positions: torch.Tensor, num_sms: int,
            out: torch.Tensor) -> torch.Tensor:
    """attn_verify: q [B, M, Hq, D] over the cache (new K/V already written) -> out."""
    B, M, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    rows = M * (Hq // Hkv)
    mt, groups, splits = verify_plan(B, M, Hq, Hkv, D, k_cache.shape[1], num_sms)
    threads, smem = verify_launch(mt, D)
    q = q.contiguous()
    if not aligned(q):
        q = q.clone()  # a fresh allocation: its 16-byte loads are aligned
    part_acc, part_ml = _partials(B * Hkv * rows * splits, D, q.device)
    name = f"attn_verify_bf16_d{D}_t{mt}"
    _allow_shared(km, "verify_attention", name, smem)
    km.launch("verify_attention", name, (B * Hkv, groups, splits), (threads,),
              (ptr(q), ptr(k_cache), ptr(v_cache), ptr(slots.contiguous()),
               ptr(positions.contiguous()), i64(k_cache.stride(0)), i64(k_cache.stride(1)),
               ptr(part_acc), ptr(part_ml), ptr(out),
               ptr(_tickets(km, B * Hkv * groups, q.device)), i32(M), i32(Hq), i32(Hkv),
               f32(D ** -0.5 / math.log(2))),
              shared_mem=smem)
    return out


def _allow_shared(km: KernelModules, file: str, name: str, smem: int) -> None:
    """Let kernel `name` launch with `smem` dynamic shared bytes (past 48 KiB it must ask),
    once per KernelModules: an entry's size is fixed (its name holds the shape), and
    `km.workspaces` records that it was asked (an empty tensor: nothing kept on the device)."""
    key = ("dynamic_shared", file, name)
    if key not in km.workspaces:
        ensure_dynamic_shared(km.function(file, name), smem)
        km.workspaces[key] = torch.empty(0)


def _lane_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [B, M, heads, D] -> (x or a dense copy, token stride) such that every lane's share of
    a row (D / 32 elements) is aligned for attn_decode's vector loads."""
    y, st = token_rows(x)
    lane_bytes = x.shape[3] // 32 * y.element_size()
    if st * y.element_size() % lane_bytes == 0 and aligned(y):
        return y, st
    return x.clone(memory_format=torch.contiguous_format), x.shape[2] * x.shape[3]  # new: aligned


def _warp_decode(km: KernelModules, sfx: str, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 num_sms: int, out: torch.Tensor, new: tuple | None = None,
                 rope: tuple | None = None, min_keys: int = DECODE_MIN_KEYS) -> torch.Tensor:
    """attn_decode: q [B, M, Hq, D] over the cache -> out.

    new = (k, v) [B, M, Hkv, D]: the step's K/V, read from there and written into the cache
    by the kernel. rope = (q_norm, k_norm, cos, sin, eps): q and k are raw, the kernel
    normalises and rotates them (needs `new`)."""
    B, M, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    rows = M * (Hq // Hkv)
    rb = 2 if rows <= 2 else 4 if rows <= 4 else 8
    splits = decode_splits(B, Hkv, k_cache.shape[1], num_sms)
    part_acc, part_ml = _partials(B * Hkv * rows * splits, D, q.device)
    q, q_st = _lane_rows(q)
    if new is None:
        new_args = (ptr(None), i64(0), ptr(None), i64(0))
    else:
        k, k_st = _lane_rows(new[0])
        v, v_st = _lane_rows(new[1])
        new_args = (ptr(k), i64(k_st), ptr(v), i64(v_st))
    if rope is None:
        name = f"attn_decode_{sfx}_d{D // 32}_r{rb}"
        rope_args = (ptr(None), ptr(None), ptr(None), ptr(None), f32(0.0))
    else:
        name = f"attn_decode_rope_{sfx}_d{D // 32}_r{rb}"
        q_norm, k_norm, cos, sin, eps = rope
        rope_args = (ptr(q_norm), ptr(k_norm), ptr(cos), ptr(sin), f32(eps))
    rope_args += (i32(min_keys),)
    km.launch("decode_attention", name, (B * Hkv, splits), (32 * DECODE_WARPS,),
              (ptr(q), i64(q_st), ptr(k_cache), ptr(v_cache), ptr(slots.contiguous()),
               ptr(positions.contiguous()), i64(k_cache.stride(0)), i64(k_cache.stride(1)),
               ptr(part_acc), ptr(part_ml), ptr(out), ptr(_tickets(km, B * Hkv, q.device)),
               i32(M), i32(Hq), i32(Hkv), f32(D ** -0.5))
              + new_args + rope_args)
    return out


def decode_attention(km: KernelModules, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     num_sms: int, out: torch.Tensor | None = None,
                     mma_verify: bool = False, mma_decode: bool = False) -> torch.Tensor:
    """q [B, M, Hq, D] over one layer's cache [slots, max_len, Hkv, D] (new K/V already
    written) -> [B, M, Hq, D]; key p visible to (b, m) iff p <= positions[b, m]. mma_verify:
    rows past attn_decode's go to attn_verify where it takes them (RuntimeOptions);
    mma_decode: attn_decode's rows too."""
    sfx = dtype_suffix(q, k_cache, v_cache)
    B, M, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if D % vec_elems(q.dtype) or D > 256 or Hq % Hkv or not k_cache.is_contiguous():
        raise Unsupported(f"head_dim {D}, heads {Hq}/{Hkv}")
    out = dest(out, q.shape, q.dtype, q.device)
    if B * M == 0:
        return out
    warp = _warp_kernel_takes(M, Hq, Hkv, D, k_cache, v_cache)
    if (mma_decode or (mma_verify and not warp)) and _verify_kernel_takes(q, k_cache, v_cache):
        return _verify(km, q, k_cache, v_cache, slots, positions, num_sms, out)
    if warp:
        return _warp_decode(km, sfx, q, k_cache, v_cache, slots, positions, num_sms, out)
    q = q.contiguous()
    rows = M * (Hq // Hkv)
    rb, groups, tile, splits, tpd = attention_plan(B, M, Hq, Hkv, D, k_cache.shape[1], num_sms)
    part_acc, part_ml = _partials(B * Hkv * rows * splits, D, q.device)
    smem = 4 * (rb * D + tile * (D + tpd) + tile * D + rb * tile + 3 * rb)
    km.launch("attention_partial", f"attn_partial_{sfx}", (B * Hkv, groups, splits),
              (ATTN_THREADS,),
              (ptr(q), ptr(k_cache), ptr(v_cache), ptr(slots.contiguous()),
               ptr(positions.contiguous()), i64(k_cache.stride(0)), i64(k_cache.stride(1)),
               ptr(part_acc), ptr(part_ml), ptr(out),
               ptr(_tickets(km, B * Hkv * groups, q.device)), i32(M), i32(Hq), i32(Hkv), i32(D),
               i32(rb), i32(tile), i32(tpd), f32(D ** -0.5)),
              shared_mem=smem)
    return out


def attention(km: KernelModules, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor, num_sms: int, out: torch.Tensor | None = None,
              min_keys: int = DECODE_MIN_KEYS, mma_verify: bool = False,
              mma_decode: bool = False) -> torch.Tensor:
    """The attention op: write k, v [B, M, Hkv, D] into one layer's cache at (slots[b],
    positions[b, m]) and attend q [B, M, Hq, D] over it -> [B, M, Hq, D].

    Where attn_decode takes the shapes it writes the cache itself (one launch; each context
    split holds at least min_keys keys); otherwise kv_write + decode_attention (two; with
    mma_verify, its tensor-core kernel where it takes the shapes; mma_decode: there too
    where attn_decode would take them)."""
    sfx = dtype_suffix(q, k, v, k_cache, v_cache)
    B, M, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    mma_decode = mma_decode and _verify_kernel_takes(q, k_cache, v_cache)
    if (mma_decode or not _warp_kernel_takes(M, Hq, Hkv, D, k_cache, v_cache)
            or B * M == 0):
        kv_write(km, k, v, k_cache, v_cache, slots, positions)
        return decode_attention(km, q, k_cache, v_cache, slots, positions, num_sms, out=out,
                                mma_verify=mma_verify, mma_decode=mma_decode)
    out = dest(out, q.shape, q.dtype, q.device)
    return _warp_decode(km, sfx, q, k_cache, v_cache, slots, positions, num_sms, out,
                        new=(k, v), min_keys=min_keys)


def rope_attention(km: KernelModules, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor, eps: float, num_sms: int,
                   out: torch.Tensor | None = None, min_keys: int = DECODE_MIN_KEYS
                   ) -> torch.Tensor:
    """attention(*qk_norm_rope(q, k, ...), v, ...) in one launch (min_keys: see attention).

    q [B, M, Hq, D], k, v [B, M, Hkv, D]: raw projections (strided views of the qkv output
    are fine); q_norm, k_norm [D]; cos, sin [max_len, D] RoPE tables (TorchBackend.allocate_kv);
    positions [B, M] int64 (consecutive per sequence, as Step builds them); slots [B] int64.
    Writes the normalised, rotated k and v into k_cache, v_cache [slots, max_len, Hkv, D] at
    (slots[b], positions[b, m]) -> [B, M, Hq, D]. Same bits as ops.qk_norm_rope followed by
    attention() on the attn_decode path. Raises Unsupported where attn_decode does not take
    the shapes (more than DECODE_MAX_ROWS query rows, head_dim not in DECODE_HEAD_DIMS) or the
    tables / weights are not dense and 16-byte aligned: the caller composes the two ops."""
    sfx = dtype_suffix(q, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache)
    B, M, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if not _warp_kernel_takes(M, Hq, Hkv, D, k_cache, v_cache):
        raise Unsupported(f"{M} tokens, heads {Hq}/{Hkv}, head_dim {D}")
    if positions.dtype != torch.long or slots.dtype != torch.long:
        raise Unsupported(f"positions {positions.dtype}, slots {slots.dtype}")
    tables = (q_norm, k_norm, cos, sin)
    if (q_norm.shape != (D,) or k_norm.shape != (D,) or cos.dim() != 2 or cos.shape[1] != D
            or sin.shape != cos.shape or not all(t.is_contiguous() for t in tables)
            or not aligned(*tables)):
        raise Unsupported(f"norm weights {tuple(q_norm.shape)} / {tuple(k_norm.shape)}, "
                          f"RoPE tables {tuple(cos.shape)} / {tuple(sin.shape)}: expected "
                          f"dense, 16-byte aligned [{D}] and [max_len, {D}]")
    out = dest(out, q.shape, q.dtype, q.device)
    if B * M == 0:
        return out
    return _warp_decode(km, sfx, q, k_cache, v_cache, slots, positions, num_sms, out,
                        new=(k, v), rope=(q_norm, k_norm, cos, sin, eps), min_keys=min_keys)
