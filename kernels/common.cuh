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
