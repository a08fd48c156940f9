// int4 weight-only skinny matmul (AWQ-style, group 128): y[M, N] = x[M, K] @ W^T, M <= 16,
// W[n, k] = (q[n, k] - zero[k / 128, n]) * scale[k / 128, n].
// q in the kernel layout of kestrel_rt/quant.py: int32 [N, K / 8], nibble i of word j holds
// k = 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i] (AWQ's interleave along k), so the masks 0x000F000F of
// w, w>>4, w>>8, w>>12 give the bf16 pairs (k0,k1), (k2,k3), (k4,k5), (k6,k7).
// zeros: AWQ qzeros int32 [K / 128, N / 8]; scales: fp16 [K / 128, N]. K % 128 == 0, N % 8 == 0.
//
// Dequantization in registers, exact: one lop3 ORs q into the bf16 pattern of 128, giving
// 128 + q, which the mma takes as it is. The zero point comes in through more mmas of the
// same x chunks with the constant A = -(128 + zero) (per row, exact in bf16) into the same
// fp32 chain: sum (128 + q) x - (128 + z) x = sum (q - z) x. Two mmas per 16 k (and n-tile)
// instead of a bf16x2 add per weight pair; the partial sums are ~30x the result, far inside
// fp32. Each thread's 16-byte load is 32 k of one row, so the 4 threads of a row group cover
// one group of 128, and the group's scale multiplies the chain once.
// A thread streams two adjacent rows (tile rows 2g, 2g + 1 as the mma's rows g, g + 8): they
// share a zeros word and a 4-byte scale load; a shuffle after the K loop gives store_out its
// order. Software pipelined: the next group's loads (weights, zeros, scales) go out before
// this group's math, the first ones before pdl_wait (weights are immutable). PRO (SwiGLU of
// x as it loads for the expert kernels; the residual and SwiGLU epilogues): gemv_mma.cuh.
#include "gemv_mma.cuh"

// -- the int4 weight stream -------------------------------------------------------------

// p itself, but opaque to the compiler, which then keeps it in registers rather than
// recomputing it from the kernel's parameters at every use in the loop (ptxas, sm_90).
template <class T>
__device__ __forceinline__ const T* kept(const T* p) {
  asm volatile("mov.b64 %0, %0;" : "+l"(p));
  return p;
}

// Chunk c (8 k) of act(x) for n-tile j: XLoad::load, except that PRO 0 reads row 0 again for
// absent rows (row >= M) instead of zeros: an mma's column of B only reaches the same column
// of C, never stored for those rows, and an unpredicated load needs no zeroing.
template <int PRO, int MT>
__device__ __forceinline__ uint4 x_chunk(const XLoad<PRO, MT>& xl, int j, int c) {
  if constexpr (PRO == 0)
    return ld_cached(xl.row[j] + c);
  else
    return xl.load(j, c);
}

// Where a thread reads (32-bit offsets from the arrays' starts: fewer registers than
// pointers, ptxas sm_90): group grp of its rows a, a + 1 is the 16-byte vector wo + 4 grp of
// q and that + wrow, their zeros word zo + grp zstep, their two fp16 scales (one u32) so +
// grp sstep.
struct Int4Src {
  const uint4* q;
  const u32 *zeros, *scales;
  u32 wo, wrow, zo, zstep, so, sstep;
};

// One pipeline stage: U groups of the thread's two rows (a, b: 32 k of each), the zeros word
// and the scales.
template <int U>
struct Int4Stage {
  uint4 a[U], b[U];
  u32 zw[U], sw[U];
};

// Loads groups s0 .. s0 + U - 1 (past the end: nothing, never used).
template <int U, bool PF>
__device__ __forceinline__ void int4_load(Int4Stage<U>& s, const Int4Src& src, u32 s0,
                                          u32 groups) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const u32 grp = s0 + u;
    if (grp < groups) {
      const u32 w = src.wo + 4 * grp;
      s.a[u] = ld_stream<PF>(src.q + w);
      s.b[u] = ld_stream<PF>(src.q + (w + src.wrow));
      s.zw[u] = __ldg(src.zeros + (src.zo + grp * src.zstep));
      s.sw[u] = __ldg(src.scales + (src.so + grp * src.sstep));
    }
  }
}

// acc += groups s0 .. s0 + U - 1 (those < groups) of the thread's rows (the mma's rows g,
// g + 8) times act(x) (n-tile j: rows 8j + g of thread (g, t)); zsh: where the rows' zero
// points sit in the zeros word.
template <int MT, int U, class XL>
__device__ __forceinline__ void int4_math(float (&acc)[MT][4], const Int4Stage<U>& s,
                                          const XL& xl, u32 s0, u32 groups, int t, u32 zsh) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const u32 grp = s0 + u;
    if (u > 0 && grp >= groups) break;  // the same in the whole warp
    const int c0 = 16 * (int)grp + 4 * t;  // the thread's first x chunk of the group
    const u32 wa[4] = {s.a[u].x, s.a[u].y, s.a[u].z, s.a[u].w};
    const u32 wb[4] = {s.b[u].x, s.b[u].y, s.b[u].z, s.b[u].w};
    // -(128 + zero) of rows a, b, each in both bf16 halves
    const u32 z2 = and_or(s.zw[u] >> zsh, 0x000F000Fu, 0xC300C300u);
    const u32 nza = __byte_perm(z2, 0u, 0x1010), nzb = __byte_perm(z2, 0u, 0x3232);
    float cg[MT][4] = {};  // the group's sum of -(128 + z) x + (128 + q) x, one chain
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint4 xv[MT];  // k 8i..8i+7 of this thread's 32
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        xv[j] = x_chunk(xl, j, c0 + i);
        mma_bf16(cg[j], nza, nzb, nza, nzb, xv[j].x, xv[j].y);
        mma_bf16(cg[j], nza, nzb, nza, nzb, xv[j].z, xv[j].w);
      }
      u32 pa[4], pb[4];  // 128 + q of k pairs (2p, 2p + 1) of word i, rows a and b
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        pa[p] = and_or(wa[i] >> (4 * p), 0x000F000Fu, 0x43004300u);
        pb[p] = and_or(wb[i] >> (4 * p), 0x000F000Fu, 0x43004300u);
      }
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        mma_bf16(cg[j], pa[0], pb[0], pa[1], pb[1], xv[j].x, xv[j].y);
        mma_bf16(cg[j], pa[2], pb[2], pa[3], pb[3], xv[j].z, xv[j].w);
      }
    }
    const float sa = f16_to_f32((u16)s.sw[u]), sb = f16_to_f32((u16)(s.sw[u] >> 16));
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      acc[j][0] = fmaf(sa, cg[j][0], acc[j][0]);
      acc[j][1] = fmaf(sa, cg[j][1], acc[j][1]);
      acc[j][2] = fmaf(sb, cg[j][2], acc[j][2]);
      acc[j][3] = fmaf(sb, cg[j][3], acc[j][3]);
    }
  }
}

// A tile's sums to store_out's order after its K loop: thread (g, t) then holds tile rows g
// (acc[j][0..1]) and g + 8 (acc[j][2..3]); row g was computed by thread (g / 2, t), row g + 8
// by (4 + g / 2, t), as its row a (acc[j][0..1]) or b (acc[j][2..3]) for g even or odd. The
// whole warp calls it.
template <int MT>
__device__ __forceinline__ void int4_store_order(float (&acc)[MT][4], int g, int t) {
  const int from = 4 * (g >> 1) + t;
#pragma unroll
  for (int j = 0; j < MT; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float r0a = __shfl_sync(0xffffffffu, acc[j][e], from);
      const float r0b = __shfl_sync(0xffffffffu, acc[j][e + 2], from);
      const float r8a = __shfl_sync(0xffffffffu, acc[j][e], from + 16);
      const float r8b = __shfl_sync(0xffffffffu, acc[j][e + 2], from + 16);
      acc[j][e] = g & 1 ? r0b : r0a;
      acc[j][e + 2] = g & 1 ? r8b : r8a;
    }
  }
}

// x: [M, K] (PRO 2: [M, 2K]); res: residual [M, N] or nullptr; red: the K-split shared
// floats.
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__device__ __forceinline__ void gemv_int4_body(const uint4* __restrict__ q,
                                               const u32* __restrict__ zeros,
                                               const u16* __restrict__ scales,
                                               const uint4* __restrict__ x, u16* y,
                                               const u16* res, int M, int N, int K,
                                               float* red) {
  static_assert(!GEMV_RSTD(PRO), "the row-scale RMSNorm is in the bf16 kernels only");
  const TileThread<KSPLIT, TPB, GEMV_GLU(PRO)> th(N);
  const int g = th.g, t = th.t, ks = th.ks;
  const u32 groups = K >> 7;  // = number of sub-steps: 4 threads x 32 k
  // Rows a, b = a + 1: the tile's rows 2g, 2g + 1 in tile_rows' order (its ra of g = 0..7,
  // then its rb); past the end the last pair again (read, never stored).
  int a;
  if (GEMV_GLU(PRO)) {
    const int half = N >> 1;
    a = min(8 * th.tile + 2 * (g & 3), half - 2) + (g >= 4 ? half : 0);
  } else {
    a = min(16 * th.tile + 2 * g, N - 2);
  }
  Int4Src src;
  src.q = q;
  src.zeros = zeros;
  src.scales = reinterpret_cast<const u32*>(scales);
  src.wrow = (u32)K >> 5;  // 16-byte vectors per row
  src.wo = a * src.wrow + t;
  src.zo = a >> 3;
  src.zstep = (u32)N >> 3;
  src.so = a >> 1;
  src.sstep = (u32)N >> 1;
  // AWQ puts column c's zero point in nibble (c % 8) / 2 + 4 (c % 2) of its word: rows a, b
  // (a even) at bits zsh.. of the word's two 16-bit halves
  const u32 zsh = 2 * (a & 7);
  float acc[MT][4] = {};
  constexpr u32 stride = KSPLIT * U;
  Int4Stage<U> cur, nxt;
  u32 grp = ks * U;
  int4_load<U, PF>(cur, src, grp, groups);  // weights only: before the wait is allowed
  pdl_wait();  // PDL: nothing is read before the previous kernel is done (see pdl.cuh)
  XLoad<GEMV_ACT(PRO), MT> xl;
  xl.init(x, g, M, K);
#pragma unroll
  for (int j = 0; j < MT; ++j) xl.row[j] = kept(xl.row[j]);
  for (; grp < groups; grp += stride) {
    int4_load<U, PF>(nxt, src, grp + stride, groups);
    int4_math<MT, U>(acc, cur, xl, grp, groups, t, zsh);
    cur = nxt;
  }
  int4_store_order<MT>(acc, g, t);
  GEMV_TRIGGER_END();
  reduce_ksplit<KSPLIT, MT * 4>(&acc[0][0], red, th.tib, ks, th.lane);
  if (ks == 0) store_out<MT, PRO>(y, res, acc, th.tile, g, t, M, N, 1.f, 1.f);
}

// y [M, N] = res + act(x) @ W^T (res: nullptr when unused; y may alias res), through the
// epilogue PRO asks for.
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__global__ void __launch_bounds__(32 * KSPLIT * TPB)
gemv_int4(const uint4* __restrict__ q, const u32* __restrict__ zeros,
          const u16* __restrict__ scales, const uint4* __restrict__ x, u16* y, int M, int N,
          int K, const u16* res) {
  __shared__ float red[KSPLIT > 1 ? TPB * KSPLIT * MT * 4 * 32 : 1];
  GEMV_TRIGGER_TOP();
  gemv_int4_body<MT, KSPLIT, TPB, U, PF, PRO>(q, zeros, scales, x, y, res, M, N, K, red);
}

// Expert-indexed (MoE): for each pair p = blockIdx.y, y[p] = act(x[p / x_div]) . W[ids[p]]^T,
// one activation row (M = 1; PRO 0 or 2: x rows [K] or gate|up [2K]). W holds E experts back
// to back; ids [P] int64 on the device, so a routed MoE layer runs without a host sync (and
// inside a CUDA graph).
template <int KSPLIT, int TPB, int U, bool PF, int PRO>
__global__ void __launch_bounds__(32 * KSPLIT * TPB)
gemv_int4_experts(const uint4* __restrict__ q, const u32* __restrict__ zeros,
                  const u16* __restrict__ scales, const uint4* __restrict__ x,
                  u16* __restrict__ y, const long long* __restrict__ ids, int x_div, int N,
                  int K) {
  static_assert(PRO == 0 || PRO == 2, "expert kernels take PRO 0 or 2");
  __shared__ float red[KSPLIT > 1 ? TPB * KSPLIT * 4 * 32 : 1];
  pdl_trigger();
  pdl_wait();  // ids come from the routing kernel
  const int p = blockIdx.y;
  const size_t e = (size_t)__ldg(ids + p);
  const size_t xs = (PRO == 2 ? 2 : 1) * (size_t)(K >> 3);  // chunks per x row
  gemv_int4_body<1, KSPLIT, TPB, U, PF, PRO>(
      q + e * N * (K >> 5), zeros + e * (K >> 7) * (N >> 3), scales + e * (K >> 7) * N,
      x + (p / x_div) * xs, y + (size_t)p * N, nullptr, 1, N, K, red);
}

// Dequantize to bf16 for prefill (then cuBLAS): W[n, k] = (q - zero) * scale, rounded once from
// fp32 like the torch reference. One thread per int32 word of q (8 k of one row) -> one
// 16-byte store. q [N, K / 8] kernel layout, zeros / scales as in gemv_int4; out [N, K] bf16.
extern "C" __global__ void dequant_int4(const u32* __restrict__ q,
                                        const u32* __restrict__ zeros,
                                        const u16* __restrict__ scales, uint4* __restrict__ out,
                                        int N, int K) {
  const long long words = (long long)N * (K >> 3);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < words;
       i += (long long)gridDim.x * blockDim.x) {
    const int n = (int)(i / (K >> 3)), j = (int)(i % (K >> 3));
    const int grp = (8 * j) >> 7;
    const int shift = 4 * (((n & 7) >> 1) + 4 * (n & 1));
    const float z = (float)((__ldg(zeros + (size_t)grp * (N >> 3) + (n >> 3)) >> shift) & 0xFu);
    const float s = f16_to_f32(__ldg(scales + (size_t)grp * N + n));
    const u32 w = __ldg(q + i);
    u16 v[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) {  // nibble p holds k offset (0, 2, 4, 6, 1, 3, 5, 7)[p]
      const int kofs = p < 4 ? 2 * p : 2 * (p - 4) + 1;
      v[kofs] = f32_to_bf16(((float)((w >> (4 * p)) & 0xFu) - z) * s);
    }
    out[i] = make_uint4(v[0] | ((u32)v[1] << 16), v[2] | ((u32)v[3] << 16),
                        v[4] | ((u32)v[5] << 16), v[6] | ((u32)v[7] << 16));
  }
}
