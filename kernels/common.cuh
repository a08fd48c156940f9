// Shared helpers for Kestrel's kernels: bf16 <-> fp32 without cuda_bf16.h (so NVRTC needs no
// toolkit headers), 16-byte vector loads, warp and block reductions.
//
// Storage types: `float` (fp32) and `bf16_t` (raw bfloat16 bits). Arithmetic is fp32.
// `Num<T>::round(v)` rounds an fp32 value to T and back: kernels use it where the torch
// reference materialises an intermediate tensor in T, so bf16 results follow the reference.
#pragma once

typedef unsigned short bf16_t;

// +infinity without <math.h> (NVRTC compiles without the host headers that define INFINITY).
__device__ __forceinline__ float inf_f() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float bf16_to_float(bf16_t h) {
  return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ bf16_t float_to_bf16(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return (bf16_t)(u >> 16);
}

template <typename T> struct Num;

template <> struct Num<float> {
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
  static __device__ __forceinline__ float round(float v) { return v; }
};

template <> struct Num<bf16_t> {
  static __device__ __forceinline__ float load(bf16_t v) { return bf16_to_float(v); }
  static __device__ __forceinline__ bf16_t store(float v) { return float_to_bf16(v); }
  static __device__ __forceinline__ float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

// Elements of T in one 16-byte vector.
template <typename T> struct Vec { static constexpr int N = 16 / (int)sizeof(T); };

// 16-byte load of Vec<T>::N elements at p (16-byte aligned) into out[0..N) as fp32.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float* out) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) out[i] = Num<T>::load(e[i]);
}

// 16-byte store of in[0..N) rounded to T at p (16-byte aligned).
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float* in) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) e[i] = Num<T>::store(in[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// One lane's share of a row: DL contiguous elements of T, accessed as one vector when
// DL * sizeof(T) is 8 or 16 bytes, two when 32 (p then aligned to 8 / 16 / 16 bytes).

// Load DL elements of T at p as fp32.
template <typename T, int DL>
__device__ __forceinline__ void load_lane(const T* p, float* out) {
  constexpr int BYTES = DL * (int)sizeof(T);
  if constexpr (BYTES == 16) {
    load_vec(p, out);
  } else if constexpr (BYTES == 32) {
    load_vec(p, out);
    load_vec(p + Vec<T>::N, out + Vec<T>::N);
  } else if constexpr (BYTES == 8) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < DL; ++i) out[i] = Num<T>::load(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < DL; ++i) out[i] = Num<T>::load(p[i]);
  }
}

// Store DL fp32 values (values of T) as T; alignment as load_lane.
template <typename T, int DL>
__device__ __forceinline__ void store_lane(T* p, const float* in) {
  constexpr int BYTES = DL * (int)sizeof(T);
  if constexpr (BYTES == 16) {
    store_vec(p, in);
  } else if constexpr (BYTES == 32) {
    store_vec(p, in);
    store_vec(p + Vec<T>::N, in + Vec<T>::N);
  } else {
#pragma unroll
    for (int i = 0; i < DL; ++i) p[i] = Num<T>::store(in[i]);
  }
}

// Copy DL elements of T (one lane's share of a row), no conversion.
template <typename T, int DL>
__device__ __forceinline__ void copy_lane(T* dst, const T* src) {
  constexpr int BYTES = DL * (int)sizeof(T);
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else if constexpr (BYTES == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  } else {
#pragma unroll
    for (int i = 0; i < DL; ++i) dst[i] = src[i];
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Warp sums of R per-lane values at once (R a power of two, <= 32), a transposed butterfly
// (R - 1 + log2(32 / R) shuffles): lane l gets the sum of s[l / (32 / R)] over the warp.
template <int R>
__device__ __forceinline__ float warp_sum_rows(float (&s)[R]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 16, half = R / 2; o > 0; o >>= 1, half >>= 1) {
    if (half > 0) {  // keep rows [hi ? half : 0, +half), send the others to lane ^ o
      const bool hi = lane & o;
#pragma unroll
      for (int i = 0; i < half; ++i) {
        const float send = hi ? s[i] : s[i + half];
        s[i] = (hi ? s[i + half] : s[i]) + __shfl_xor_sync(0xffffffffu, send, o);
      }
    } else {
      s[0] += __shfl_xor_sync(0xffffffffu, s[0], o);
    }
  }
  return s[0];
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// red: __shared__ float[32], reusable after the call returns.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < warps ? red[lane] : 0.f;
  return warp_sum(v);
}

// RMSNorm (weight w) then RoPE (rotate-half) of one attention head, rounded as
// TorchBackend.qk_norm_rope materialises it (h = D/2, c = cos[p], s = sin[p]):
//   y = T(w * T(x * rsqrt(mean(x^2) + eps))),
//   out[p] = T(T(y[p] * c) - T(y[p+h] * s)),  out[p+h] = T(T(y[p+h] * c) + T(y[p] * s)).
// Layout: D = 32 * DL, lane l holds elements [l*DL, l*DL + DL) in x (fp32 values of T); w holds
// the weights of those elements, c / s the cos / sin of pair index p = (l & 15) * DL + i. The
// partner of element i of lane l is element i of lane l ^ 16. x is replaced by the result
// (values of T). Explicit _rn intrinsics: no FMA contraction, so every kernel that calls this
// gets the same bits. All 32 lanes of the warp must call it.
template <typename T, int DL>
__device__ __forceinline__ void head_norm_rope(float (&x)[DL], const float (&w)[DL],
                                               const float (&c)[DL], const float (&s)[DL],
                                               int lane, float eps) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < DL; ++i) ss = __fmaf_rn(x[i], x[i], ss);
  constexpr bool POW2 = (DL & (DL - 1)) == 0;  // x / D == x * (1 / D) exactly: no division
  const float sum = warp_sum(ss);
  const float mean = POW2 ? __fmul_rn(sum, 1.f / (32 * DL)) : __fdiv_rn(sum, (float)(32 * DL));
  const float rstd = rsqrtf(__fadd_rn(mean, eps));
  const bool first_half = lane < 16;
#pragma unroll
  for (int i = 0; i < DL; ++i) {
    const float y = Num<T>::round(__fmul_rn(w[i], Num<T>::round(__fmul_rn(x[i], rstd))));
    const float other = __shfl_xor_sync(0xffffffffu, y, 16);
    const float yc = Num<T>::round(__fmul_rn(y, c[i]));
    const float os = Num<T>::round(__fmul_rn(other, s[i]));
    x[i] = Num<T>::round(first_half ? __fsub_rn(yc, os) : __fadd_rn(yc, os));
  }
}

// -- split-context attention: merging the splits ("last block merges") ----------------------
// Partials of query row `row` (ordered (b, kvh, r), r = m * G + g of the R = M * G rows of a kv
// head) and split s of S: unnormalised acc [D] at part_acc[(row * S + s) * D], (max, sum) of
// its scores at part_ml[(row * S + s) * 2]; max = -inf where the split saw no key of the row.
// Read through L2 (__ldcg): other blocks of the same grid wrote them.

// Called by every block of a group of n (the splits of one (sequence, kv head[, row group]))
// once it has written its partials. True, in every thread, in the block that arrives last:
// it then sees all the group's partials, and it has reset the group's int32 ticket to 0 (zero
// before the first launch, so zero before every launch). n == 1: true without the ticket.
__device__ __forceinline__ bool last_to_arrive(int* ticket, int n) {
  __shared__ int s_last;
  __threadfence();  // release: this thread's partials before its block's arrival
  __syncthreads();
  if (n == 1) return true;
  if (threadIdx.x == 0) {
    s_last = atomicAdd(ticket, 1) == n - 1;
    if (s_last) {
      atomicExch(ticket, 0);
      __threadfence();  // acquire: the other blocks' partials after their arrivals
    }
  }
  __syncthreads();
  return s_last;
}

// w[s] = exp(max_s - max) of a row's first n (<= 64) splits, 0 where max_s = -inf; returns
// the denominator sum_s w[s] * sum_s. One whole warp: lane l takes splits l and l + 32.
__device__ __forceinline__ float split_weights(const float* ml, int n, float* w) {
  const int lane = threadIdx.x & 31;
  float m[2], l[2], den[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m[h] = -inf_f();
    l[h] = 0.f;
    if (lane + 32 * h < n) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(ml) + lane + 32 * h);
      m[h] = v.x;
      l[h] = v.y;
    }
  }
  const float mx = warp_max(fmaxf(m[0], m[1]));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float wgt = m[h] == -inf_f() ? 0.f : expf(m[h] - mx);
    if (lane + 32 * h < n) w[lane + 32 * h] = wgt;
    den[h] = warp_sum(wgt * l[h]);
  }
  return den[0] + den[1];
}

__device__ __forceinline__ void fma4(float (&a)[4], float4 x, float w) {
  a[0] = fmaf(x.x, w, a[0]);
  a[1] = fmaf(x.y, w, a[1]);
  a[2] = fmaf(x.z, w, a[2]);
  a[3] = fmaf(x.w, w, a[3]);
}

// o[0..4) = sum over splits s < n of w[s] * acc[s * d + 0..4) (acc 16-byte aligned): split s
// adds into accumulator s % 4, then (a0 + a1) + (a2 + a3), so splits past n with w = 0 would
// not change a bit. Eight splits' loads in flight (the last group's index clamped to n - 1).
__device__ __forceinline__ void split_sum4(const float* acc, const float* w, int n, int d,
                                           float (&o)[4]) {
  float a[4][4] = {};  // [accumulator][column]
  for (int s = 0; s < n; s += 8) {
    float4 x[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int at = s + u < n ? s + u : n - 1;
      x[u] = __ldcg(reinterpret_cast<const float4*>(acc + (long long)at * d));
    }
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (s + u < n) fma4(a[u & 3], x[u], w[s + u]);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) o[c] = (a[0][c] + a[1][c]) + (a[2][c] + a[3][c]);
}

// Merge splits 0 .. n (n <= 64 of S = splits) of query rows r0 .. r0 + nrows of kv head kvh of
// sequence b into out [B, M, Hq, D]. d % 4 == 0; the whole block calls it. Eight rows at a
// time: a warp per row computes the weights, then each thread 4 columns of a row.
template <typename T>
__device__ void merge_rows(const float* part_acc, const float* part_ml, T* out, int b, int kvh,
                           int r0, int nrows, int m_tokens, int hq, int hkv, int d, int splits,
                           int n) {
  __shared__ float s_w[8][64];
  __shared__ float s_den[8];
  const int g_size = hq / hkv, quads = d / 4;
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int c0 = 0; c0 < nrows; c0 += 8) {
    const int rows = nrows - c0 < 8 ? nrows - c0 : 8;
    const long long row0 = ((long long)b * hkv + kvh) * (m_tokens * g_size) + r0 + c0;
    for (int r = warp; r < rows; r += warps)
      s_den[r] = split_weights(part_ml + (row0 + r) * splits * 2, n, s_w[r]);
    __syncthreads();
    for (int e = threadIdx.x; e < rows * quads; e += blockDim.x) {
      const int r = e / quads, c = e % quads * 4, gr = r0 + c0 + r;
      float o[4];
      split_sum4(part_acc + (row0 + r) * splits * d + c, s_w[r], n, d, o);
      T* dst = out + (((long long)b * m_tokens + gr / g_size) * hq + kvh * g_size + gr % g_size)
                         * d + c;
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = Num<T>::store(o[i] / s_den[r]);
    }
    __syncthreads();
  }
}
