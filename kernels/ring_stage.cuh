// What the persistent gemvs (gemv_ring.cu, gemv_bulk.cu) share: the prologues they take, and
// x staged in shared memory once per block (stage_x, read back with xs_chunk).
#pragma once
#include "int4_math.cuh"

// The PROs the ring kernels take: plain x or its RMSNorm, a residual or the SwiGLU epilogue.
#define GEMV_RING_PRO(PRO) \
  (GEMV_ACT(PRO) <= 1 && !GEMV_RSTD(PRO) && !GEMV_SSQ(PRO) && !GEMV_RSTD_IN(PRO))

// Where x chunk c of a row sits in the int4 ring's staged copy: c with bit 1 flipped where
// bit 3 is set. A thread reads the chunks 4t + i of its group, one i at a time across the
// warp's 4 t: unswizzled, t = 0, 2 (and 1, 3) hit the same banks (64 bytes apart: a 2-way
// conflict); swizzled, the four sit in four bank quarters. An involution.
__device__ __forceinline__ int x_swizzle(int c) { return c ^ ((c >> 2) & 2); }

// act(x) rows m < M of x [M, K] into xs [M][K / 8] (SWZ: chunk v of a row at x_swizzle(v)): x itself (ACT 0) or its RMSNorm with
// weight nw [K] (ACT 1, gemv_mma.cuh's PRO 1 rounding: bf16(nw * bf16(x * rstd)), rstd =
// rsqrt(sum x^2 / K + eps), the sum in a fixed order: each thread its chunks tid, tid + T,
// ..., then the warps' shuffle tree, then the WARPS partials in warp order). part: shared
// floats [(WARPS + 1) * 8]. SSQ (ACT 0): x as it is, and each warp's sums of squares of the
// rows' chunks it staged in part[warp * 8 + m] (staged_rstd adds them up: a row scale of the
// result, the norm weight folded into W). The whole block calls it (ending with a
// __syncthreads).
template <int ACT, int WARPS, bool SWZ = false, bool SSQ = false>
__device__ __forceinline__ void stage_x(uint4* xs, const uint4* x, const uint4* nw, float eps,
                                        int M, int kv, float* part) {
  static_assert(!SSQ || ACT == 0, "SSQ stages plain x");
  if constexpr (SSQ) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int m = 0; m < M; ++m) {
      float ss = 0.f;
#pragma unroll 4
      for (int v = threadIdx.x; v < kv; v += blockDim.x) {
        const uint4 c = ld_cached(x + m * kv + v);
        xs[m * kv + (SWZ ? x_swizzle(v) : v)] = c;
        ss = sum_squares(c, ss);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) part[warp * 8 + m] = ss;
    }
  } else {
#pragma unroll 4
    for (int c = threadIdx.x; c < M * kv; c += blockDim.x) {
      const int m = c / kv, v = c - m * kv;
      xs[m * kv + (SWZ ? x_swizzle(v) : v)] = ld_cached(x + c);
    }
  }
  if constexpr (ACT == 1) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    for (int m = 0; m < M; ++m) {
      float ss = 0.f;
      for (int v = threadIdx.x; v < kv; v += blockDim.x) ss = sum_squares(xs[m * kv + v], ss);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) part[warp * 8 + m] = ss;
    }
    __syncthreads();
    if (threadIdx.x < M) {
      float ss = 0.f;
      for (int w = 0; w < WARPS; ++w) ss += part[w * 8 + threadIdx.x];
      part[WARPS * 8 + threadIdx.x] = rsqrtf(ss / (float)(8 * kv) + eps);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < M * kv; c += blockDim.x) {
      const int m = c / kv, v = c - m * kv;  // xs[c] holds chunk v, or x_swizzle(v) (SWZ)
      const float r = part[WARPS * 8 + m];
      const uint4 a = xs[c], w = ld_cached(nw + (SWZ ? x_swizzle(v) : v));
      xs[c] = make_uint4(rmsnorm2(a.x, w.x, r), rmsnorm2(a.y, w.y, r), rmsnorm2(a.z, w.z, r),
                         rmsnorm2(a.w, w.w, r));
    }
  }
  __syncthreads();
}

// rsqrt(mean(x[m]^2) + eps) of row m < M of x [M, K] from stage_x<0, WARPS, SWZ, true>'s
// partials (added in warp order, as stage_x's RMSNorm adds them).
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
