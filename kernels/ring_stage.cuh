// What the persistent gemvs (gemv_ring.cu, gemv_bulk.cu) share: the prologues they take, and
// x staged in shared memory once per block (stage_x, read back with xs_chunk).
#pragma once
#include "gemv_mma.cuh"

// The PROs the ring kernel takes (and the bulk kernel, which adds more): plain x, with a
// residual or the SwiGLU epilogue.
#define GEMV_RING_PRO(PRO) ((PRO) == 0 || (PRO) == 4 || (PRO) == 8)

// Rows m < M of x [M, K] into xs [M][K / 8], the whole block copying in turn. RSTD: also each
// warp's sums of squares of the rows' chunks it staged, in part[warp * 8 + m] (staged_rstd
// adds them up: the row-scale RMSNorm, gemv_mma.cuh). The whole block calls it (ending with
// a __syncthreads).
template <bool RSTD = false>
__device__ __forceinline__ void stage_x(uint4* xs, const uint4* x, int M, int kv, float* part) {
  if constexpr (RSTD) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int m = 0; m < M; ++m) {
      float ss = 0.f;
#pragma unroll 4
      for (int v = threadIdx.x; v < kv; v += blockDim.x) {
        const uint4 c = ld_cached(x + m * kv + v);
        xs[m * kv + v] = c;
        ss = sum_squares(c, ss);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) part[warp * 8 + m] = ss;
    }
  } else {
#pragma unroll 4
    for (int c = threadIdx.x; c < M * kv; c += blockDim.x) xs[c] = ld_cached(x + c);
  }
  __syncthreads();
}

// rsqrt(mean(x[m]^2) + eps) of row m < M of x [M, K] from stage_x<true>'s partials of a block
// of WARPS warps (added in warp order: deterministic, the same value in every block).
template <int WARPS>
__device__ __forceinline__ float staged_rstd(const float* part, int m, int K, float eps) {
  float ss = 0.f;
  for (int w = 0; w < WARPS; ++w) ss += part[w * 8 + m];
  return rsqrtf(ss / (float)K + eps);
}

// x chunk v of activation row g + 8 j from the staged rows (zero for rows >= M: gemv.cu's
// convention, so absent rows never meet a NaN weight product).
__device__ __forceinline__ uint4 xs_chunk(const uint4* xs, int g, int M, int kv, int v) {
  return g < M ? xs[g * kv + v] : zero4();
}
