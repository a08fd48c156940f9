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
// this group's math, the first ones before pdl_wait (weights are immutable). PRO (RMSNorm /
// SwiGLU of x as it loads) and the optional residual: gemv_mma.cuh.
#include "int4_math.cuh"

// x: [M, K] (PRO 2: [M, 2K]); nw: PRO 1; eps: PRO 1 and RSTD_IN; res: residual [M, N] or
// nullptr; ssq_out: SSQ's [M, ceil(N / 16)]; ssq_in: RSTD_IN's [M, ceil(K / 16)]; red: the
// K-split shared floats; part: ProShared floats.
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__device__ __forceinline__ void gemv_int4_body(const uint4* __restrict__ q,
                                               const u32* __restrict__ zeros,
                                               const u16* __restrict__ scales,
                                               const uint4* __restrict__ x, u16* y,
                                               const uint4* nw, float eps, const u16* res,
                                               float* ssq_out, const float* ssq_in, int M,
                                               int N, int K, float* red, float* part) {
  static_assert(!GEMV_RSTD(PRO), "the per-chunk row-scale RMSNorm is in the bf16 kernel only");
  static_assert(!GEMV_RSTD_IN(PRO) || GEMV_ACT(PRO) == 0, "RSTD_IN takes plain x");
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
  xl.template init<KSPLIT * TPB>(x, nw, part, g, M, K, eps);
  // RSTD_IN: the rows' sums of squares from ssq_in (the first weights are in flight)
  if constexpr (GEMV_RSTD_IN(PRO)) ssq_rows<KSPLIT * TPB>(ssq_in, part, M, (K + 15) >> 4);
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
  if (ks == 0) {
    if constexpr (GEMV_RSTD_IN(PRO)) scale_by_rstd_in<MT, KSPLIT * TPB>(acc, part, t, M, K, eps);
    store_out<MT, PRO>(y, res, acc, th.tile, g, t, M, N, 1.f, 1.f, ssq_out);
  }
}

// y [M, N] = res + act(x) @ W^T (res, nw, ssq_out, ssq_in: nullptr when unused; y may alias
// res). SSQ / RSTD_IN: as gemv_bf16.
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__global__ void __launch_bounds__(32 * KSPLIT * TPB)
gemv_int4(const uint4* __restrict__ q, const u32* __restrict__ zeros,
          const u16* __restrict__ scales, const uint4* __restrict__ x, u16* y, int M, int N,
          int K, const uint4* __restrict__ nw, float eps, const u16* res, float* ssq_out,
          const float* __restrict__ ssq_in) {
  __shared__ float red[KSPLIT > 1 ? TPB * KSPLIT * MT * 4 * 32 : 1];
  __shared__ float part[ProShared<PRO, KSPLIT * TPB>::N];
  GEMV_TRIGGER_TOP();
  gemv_int4_body<MT, KSPLIT, TPB, U, PF, PRO>(q, zeros, scales, x, y, nw, eps, res, ssq_out,
                                              ssq_in, M, N, K, red, part);
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
      x + (p / x_div) * xs, y + (size_t)p * N, nullptr, 0.f, nullptr, nullptr, nullptr, 1, N, K,
      red, nullptr);
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
