// bf16 skinny matmul for decode / verify: y[M, N] = x[M, K] @ W[N, K]^T, M <= 16.
// W, x, y bf16 row-major, contiguous; K % 8 == 0; 16-byte aligned. See gemv_mma.cuh (PRO:
// SwiGLU of x as it loads for the expert kernels; the residual, SwiGLU and row-scale
// RMSNorm epilogues).
// Each thread streams 16-byte chunks (8 k) of two weight rows: per sub-step the 4 threads of
// a row group cover 32 consecutive k (64 bytes). Software pipelined: the loads of the next
// iteration (U sub-steps: 2U weight vectors + the activations) are issued before the mmas of
// the current one, and the mmas alternate between two accumulators (shorter chains).
#include "gemv_mma.cuh"

// x: [M, K] (PRO 2: [M, 2K]); eps: RSTD; res: residual [M, N] or nullptr; red: the K-split
// shared floats.
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__device__ __forceinline__ void gemv_bf16_body(const uint4* __restrict__ w,
                                               const uint4* __restrict__ x, u16* y, float eps,
                                               const u16* res, int M, int N, int K,
                                               float* red) {
  const TileThread<KSPLIT, TPB, GEMV_GLU(PRO)> th(N);
  const int g = th.g, t = th.t, ks = th.ks;
  const int kv = K >> 3;  // 16-byte vectors per row
  const uint4* wa = w + (size_t)th.ra * kv;
  const uint4* wb = w + (size_t)th.rb * kv;
  static_assert(!GEMV_RSTD(PRO) || GEMV_ACT(PRO) == 0, "the row-scale RMSNorm takes plain x");
  float acc[2][MT][4] = {};
  float ss[MT] = {};  // RSTD: sums of squares of the activation rows' chunks this lane loads
  const int nsub = (kv + 3) >> 2, stride = KSPLIT * U;
  uint4 A[U], B[U], X[U][MT][1];
  pdl_wait();  // PDL: nothing is read before the previous kernel is done (see pdl.cuh)
  XLoad<GEMV_ACT(PRO), MT> xl;
  xl.init(x, g, M, K);
  load_stage<MT, U, 1, PF>(A, B, X, wa, wb, xl, ks * U, t, kv);
  for (int s0 = ks * U; s0 < nsub; s0 += stride) {
    uint4 An[U], Bn[U], Xn[U][MT][1];
    load_stage<MT, U, 1, PF>(An, Bn, Xn, wa, wb, xl, s0 + stride, t, kv);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        mma_bf16(acc[0][j], A[u].x, B[u].x, A[u].y, B[u].y, X[u][j][0].x, X[u][j][0].y);
        mma_bf16(acc[1][j], A[u].z, B[u].z, A[u].w, B[u].w, X[u][j][0].z, X[u][j][0].w);
        if constexpr (GEMV_RSTD(PRO)) ss[j] = sum_squares(X[u][j][0], ss[j]);
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      A[u] = An[u];
      B[u] = Bn[u];
#pragma unroll
      for (int j = 0; j < MT; ++j) X[u][j][0] = Xn[u][j][0];
    }
  }
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[0][j][c] += acc[1][j][c];
  GEMV_TRIGGER_END();
  if constexpr (GEMV_RSTD(PRO)) {
    float tot[MT][5];
#pragma unroll
    for (int j = 0; j < MT; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) tot[j][c] = acc[0][j][c];
      tot[j][4] = ss[j];
    }
    reduce_ksplit<KSPLIT, MT * 5>(&tot[0][0], red, th.tib, ks, th.lane);
    if (ks == 0) {
      scale_by_rstd<MT>(tot, acc[0], t, K, eps);
      store_out<MT, PRO>(y, res, acc[0], th.tile, g, t, M, N, 1.f, 1.f);
    }
  } else {
    reduce_ksplit<KSPLIT, MT * 4>(&acc[0][0][0], red, th.tib, ks, th.lane);
    if (ks == 0) store_out<MT, PRO>(y, res, acc[0], th.tile, g, t, M, N, 1.f, 1.f);
  }
}

// y [M, N] = res + act(x) @ W^T (res: nullptr when unused; y may alias res), through the
// epilogue PRO asks for (RSTD: y[m] scaled by rsqrt(mean(x[m]^2) + eps)).
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__global__ void __launch_bounds__(32 * KSPLIT * TPB)
gemv_bf16(const uint4* __restrict__ w, const uint4* __restrict__ x, u16* y, int M, int N, int K,
          float eps, const u16* res) {
  __shared__ float red[KSPLIT > 1 ? TPB * KSPLIT * MT * (GEMV_RSTD(PRO) ? 5 : 4) * 32 : 1];
  GEMV_TRIGGER_TOP();
  gemv_bf16_body<MT, KSPLIT, TPB, U, PF, PRO>(w, x, y, eps, res, M, N, K, red);
}

// Expert-indexed (MoE): for each pair p = blockIdx.y, y[p] = act(x[p / x_div]) . W[ids[p]]^T,
// one activation row (M = 1; PRO 0 or 2: x rows [K] or gate|up [2K]). W holds E experts back
// to back; ids [P] int64 on the device, so a routed MoE layer runs without a host sync (and
// inside a CUDA graph).
template <int KSPLIT, int TPB, int U, bool PF, int PRO>
__global__ void __launch_bounds__(32 * KSPLIT * TPB)
gemv_bf16_experts(const uint4* __restrict__ w, const uint4* __restrict__ x, u16* __restrict__ y,
                  const long long* __restrict__ ids, int x_div, int N, int K) {
  static_assert(PRO == 0 || PRO == 2, "expert kernels take PRO 0 or 2");
  __shared__ float red[KSPLIT > 1 ? TPB * KSPLIT * 4 * 32 : 1];
  pdl_trigger();
  pdl_wait();  // ids come from the routing kernel
  const int p = blockIdx.y;
  const size_t e = (size_t)__ldg(ids + p);
  const size_t xs = (PRO == 2 ? 2 : 1) * (size_t)(K >> 3);  // chunks per x row
  gemv_bf16_body<1, KSPLIT, TPB, U, PF, PRO>(w + e * N * (K >> 3), x + (p / x_div) * xs,
                                             y + (size_t)p * N, 0.f, nullptr, 1, N, K, red);
}
