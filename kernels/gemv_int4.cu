// int4 weight-only skinny matmul (AWQ-style, group 128): y[M, N] = x[M, K] @ W^T, M <= 16,
// W[n, k] = (q[n, k] - zero[k / 128, n]) * scale[k / 128, n].
// q in the kernel layout of kestrel_rt/quant.py: int32 [N, K / 8], nibble i of word j holds
// k = 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i] (AWQ's interleave along k), so the masks 0x000F000F of
// w, w>>4, w>>8, w>>12 give the bf16 pairs (k0,k1), (k2,k3), (k4,k5), (k6,k7).
// zeros: AWQ qzeros int32 [K / 128, N / 8]; scales: fp16 [K / 128, N]. K % 128 == 0, N % 8 == 0.
//
// Dequantization in registers, exact: (128 + q) by OR into the bf16 pattern of 128, then one
// bf16x2 add of -(128 + zero) gives the integer q - zero in bf16. Each thread's 16-byte load
// is 32 k of one row, so the 4 threads of a row group cover one group of 128: the mma sums
// (q - z) x over the group into fp32, and the group's scale multiplies that partial sum once.
// Software pipelined like gemv.cu: the next iteration's weight loads go out before this
// iteration's math; two mma chains per group. PRO (RMSNorm / SwiGLU of x as it loads) and
// the optional residual: gemv_mma.cuh.
#include "gemv_mma.cuh"

// Loads of U groups: weight vectors of rows a / b and each group's zero points (as
// -(128 + z) in both bf16 halves) and scales. (Activations are loaded where they are used:
// they hit L1, and prefetching them too would spill registers.)
template <int U, bool PF>
__device__ __forceinline__ void int4_load(uint4 (&A)[U], uint4 (&B)[U], u32 (&nz)[U][2],
                                          float (&sc)[U][2], const uint4* qa, const uint4* qb,
                                          const u32* zeros, const u16* scales, int ra, int rb,
                                          int za_shift, int zb_shift, int s0, int t, int groups,
                                          int N) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int grp = s0 + u;
    const bool ok = grp < groups;
    const int v = grp * 4 + t;
    A[u] = ok ? ld_stream<PF>(qa + v) : zero4();
    B[u] = ok ? ld_stream<PF>(qb + v) : zero4();
    u32 za = 0u, zb = 0u;
    float sa = 0.f, sb = 0.f;
    if (ok) {
      za = (__ldg(zeros + (size_t)grp * (N >> 3) + (ra >> 3)) >> za_shift) & 0xFu;
      zb = (__ldg(zeros + (size_t)grp * (N >> 3) + (rb >> 3)) >> zb_shift) & 0xFu;
      sa = f16_to_f32(__ldg(scales + (size_t)grp * N + ra));
      sb = f16_to_f32(__ldg(scales + (size_t)grp * N + rb));
    }
    nz[u][0] = (0xC300u | za) * 0x00010001u;
    nz[u][1] = (0xC300u | zb) * 0x00010001u;
    sc[u][0] = sa;
    sc[u][1] = sb;
  }
}

// x: [M, K] (PRO 2: [M, 2K]); nw, eps: PRO 1; res: residual [M, N] or nullptr; red: the
// K-split shared floats; part: ProShared floats.
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__device__ __forceinline__ void gemv_int4_body(const uint4* __restrict__ q,
                                               const u32* __restrict__ zeros,
                                               const u16* __restrict__ scales,
                                               const uint4* __restrict__ x, u16* y,
                                               const uint4* nw, float eps, const u16* res,
                                               int M, int N, int K, float* red, float* part) {
  static_assert(!GEMV_RSTD(PRO), "the row-scale RMSNorm is in the bf16 kernel only");
  const TileThread<KSPLIT, TPB, GEMV_GLU(PRO)> th(N);
  const int g = th.g, t = th.t, ks = th.ks;
  const int qv = K >> 5;      // 16-byte vectors (32 k) per weight row
  const int groups = K >> 7;  // = number of sub-steps: 4 threads x 32 k
  const int ra = th.ra, rb = th.rb;
  const uint4* qa = q + (size_t)ra * qv;
  const uint4* qb = q + (size_t)rb * qv;
  // nibble of column c in an AWQ zeros word: index (c / 2) + 4 (c % 2)
  const int za_shift = 4 * (((ra & 7) >> 1) + 4 * (ra & 1));
  const int zb_shift = 4 * (((rb & 7) >> 1) + 4 * (rb & 1));
  float acc[MT][4] = {};
  const int stride = KSPLIT * U;
  uint4 A[U], B[U];
  u32 nz[U][2];
  float sc[U][2];
  prefetch_then_wait<U>(qa, qb, ks * U, t, qv);  // then nothing but weights before the wait
  XLoad<GEMV_ACT(PRO), MT> xl;
  xl.template init<KSPLIT * TPB>(x, nw, part, g, M, K, eps);
  int4_load<U, PF>(A, B, nz, sc, qa, qb, zeros, scales, ra, rb, za_shift, zb_shift, ks * U, t,
                   groups, N);
  for (int s0 = ks * U; s0 < groups; s0 += stride) {
    uint4 An[U], Bn[U];
    u32 nzn[U][2];
    float scn[U][2];
    int4_load<U, PF>(An, Bn, nzn, scn, qa, qb, zeros, scales, ra, rb, za_shift, zb_shift,
                     s0 + stride, t, groups, N);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = (s0 + u) * 4 + t;
      const bool ok = s0 + u < groups;
      const u32 wa[4] = {A[u].x, A[u].y, A[u].z, A[u].w};
      const u32 wb[4] = {B[u].x, B[u].y, B[u].z, B[u].w};
      float cg[2][MT][4] = {};  // the group's (q - z).x, two mma chains
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u32 pa[4], pb[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          pa[p] = bf16x2_add(and_or(wa[i] >> (4 * p), 0x000F000Fu, 0x43004300u), nz[u][0]);
          pb[p] = bf16x2_add(and_or(wb[i] >> (4 * p), 0x000F000Fu, 0x43004300u), nz[u][1]);
        }
#pragma unroll
        for (int j = 0; j < MT; ++j) {
          // k 8i..8i+7 of this thread's 32
          const uint4 xv = ok ? xl.load(j, 4 * v + i) : zero4();
          mma_bf16(cg[0][j], pa[0], pb[0], pa[1], pb[1], xv.x, xv.y);
          mma_bf16(cg[1][j], pa[2], pb[2], pa[3], pb[3], xv.z, xv.w);
        }
      }
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        acc[j][0] += sc[u][0] * (cg[0][j][0] + cg[1][j][0]);
        acc[j][1] += sc[u][0] * (cg[0][j][1] + cg[1][j][1]);
        acc[j][2] += sc[u][1] * (cg[0][j][2] + cg[1][j][2]);
        acc[j][3] += sc[u][1] * (cg[0][j][3] + cg[1][j][3]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      A[u] = An[u];
      B[u] = Bn[u];
      nz[u][0] = nzn[u][0];
      nz[u][1] = nzn[u][1];
      sc[u][0] = scn[u][0];
      sc[u][1] = scn[u][1];
    }
  }
  GEMV_TRIGGER_END();
  reduce_ksplit<KSPLIT, MT * 4>(&acc[0][0], red, th.tib, ks, th.lane);
  if (ks == 0) store_out<MT, PRO>(y, res, acc, th.tile, g, t, M, N, 1.f, 1.f);
}

// y [M, N] = res + act(x) @ W^T (res, nw: nullptr when unused; y may alias res).
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__global__ void __launch_bounds__(32 * KSPLIT * TPB)
gemv_int4(const uint4* __restrict__ q, const u32* __restrict__ zeros,
          const u16* __restrict__ scales, const uint4* __restrict__ x, u16* y, int M, int N,
          int K, const uint4* __restrict__ nw, float eps, const u16* res) {
  __shared__ float red[KSPLIT > 1 ? TPB * KSPLIT * MT * 4 * 32 : 1];
  __shared__ float part[ProShared<GEMV_ACT(PRO), KSPLIT * TPB>::N];
  GEMV_TRIGGER_TOP();
  gemv_int4_body<MT, KSPLIT, TPB, U, PF, PRO>(q, zeros, scales, x, y, nw, eps, res, M, N, K,
                                              red, part);
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
      x + (p / x_div) * xs, y + (size_t)p * N, nullptr, 0.f, nullptr, 1, N, K, red, nullptr);
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
