// Per-head RMSNorm of q and k over head_dim, then RoPE (rotate-half, as transformers' Qwen3).
//
// Token t (of B*M, row-major over [B, M]) at position pos = positions[t]; for each head:
//   y  = T(w * T(x * rsqrt(mean(x^2) + eps)))                   (the RMSNorm op's rounding)
//   out[p]        = T(T(y[p] * c) - T(y[p+h] * s))               p < h = D/2,
//   out[p + h]    = T(T(y[p+h] * c) + T(y[p] * s))               c = cos[pos, p], s = sin[pos, p]
// cos/sin: [max_pos, D] tables in T (cos[:, p] == cos[:, p + h], as transformers builds them).
// q: [tokens, Hq, D] with token stride q_st and head stride D (a view of the qkv output is
// fine); k likewise with k_st. Outputs q_out [tokens, Hq, D], k_out [tokens, Hkv, D], dense.
// Grid (tokens, head groups): one warp per (token, head). D a multiple of 32: lane l holds
// elements [l * D/32, (l + 1) * D/32) and the math is common.cuh's head_norm_rope, the helper
// the fused decode attention (decode_attention.cu) calls, so both give the same bits. Other
// D (even, <= 256): lane l handles pairs p = l, l + 32, ...
#include "common.cuh"

// One head in the lane layout of head_norm_rope (D = 32 * DL); element loads, any alignment.
template <typename T, int DL>
__device__ __forceinline__ void norm_rope_head_lanes(const T* __restrict__ src,
                                                     const T* __restrict__ w,
                                                     const T* __restrict__ cos_row,
                                                     const T* __restrict__ sin_row,
                                                     T* __restrict__ dst, int lane, float eps) {
  float x[DL], wv[DL], c[DL], s[DL];
  const int e0 = lane * DL, p0 = (lane & 15) * DL;
#pragma unroll
  for (int i = 0; i < DL; ++i) {
    x[i] = Num<T>::load(src[e0 + i]);
    wv[i] = Num<T>::load(w[e0 + i]);
    c[i] = Num<T>::load(cos_row[p0 + i]);
    s[i] = Num<T>::load(sin_row[p0 + i]);
  }
  head_norm_rope<T, DL>(x, wv, c, s, lane, eps);
#pragma unroll
  for (int i = 0; i < DL; ++i) dst[e0 + i] = Num<T>::store(x[i]);
}

template <typename T>
__device__ void qk_norm_rope_impl(const T* __restrict__ q, long long q_st,
                                  const T* __restrict__ k, long long k_st,
                                  const T* __restrict__ qw, const T* __restrict__ kw,
                                  const T* __restrict__ cos_t, const T* __restrict__ sin_t,
                                  const long long* __restrict__ positions,
                                  T* __restrict__ q_out, T* __restrict__ k_out, int hq, int hkv,
                                  int d, float eps) {
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  const long long t = blockIdx.x;
  const long long pos = positions[t];
  const int half = d >> 1;
  for (int head = blockIdx.y * warps + (threadIdx.x >> 5); head < hq + hkv;
       head += warps * gridDim.y) {
    const bool is_q = head < hq;
    const int hh = is_q ? head : head - hq;
    const T* src = is_q ? q + t * q_st + (long long)hh * d : k + t * k_st + (long long)hh * d;
    const T* w = is_q ? qw : kw;
    T* dst = is_q ? q_out + (t * hq + hh) * d : k_out + (t * hkv + hh) * d;
    if ((d & 31) == 0) {  // warp-uniform: the lane layout shared with the attention kernel
      const T* c_row = cos_t + pos * d;
      const T* s_row = sin_t + pos * d;
      switch (d >> 5) {
        case 1: norm_rope_head_lanes<T, 1>(src, w, c_row, s_row, dst, lane, eps); break;
        case 2: norm_rope_head_lanes<T, 2>(src, w, c_row, s_row, dst, lane, eps); break;
        case 3: norm_rope_head_lanes<T, 3>(src, w, c_row, s_row, dst, lane, eps); break;
        case 4: norm_rope_head_lanes<T, 4>(src, w, c_row, s_row, dst, lane, eps); break;
        case 5: norm_rope_head_lanes<T, 5>(src, w, c_row, s_row, dst, lane, eps); break;
        case 6: norm_rope_head_lanes<T, 6>(src, w, c_row, s_row, dst, lane, eps); break;
        case 7: norm_rope_head_lanes<T, 7>(src, w, c_row, s_row, dst, lane, eps); break;
        default: norm_rope_head_lanes<T, 8>(src, w, c_row, s_row, dst, lane, eps); break;
      }
      continue;
    }
    float a[4], b[4];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int p = lane + 32 * i;
      a[i] = b[i] = 0.f;
      if (p < half) {
        a[i] = Num<T>::load(src[p]);
        b[i] = Num<T>::load(src[p + half]);
        ss += a[i] * a[i] + b[i] * b[i];
      }
    }
    const float rstd = rsqrtf(warp_sum(ss) / (float)d + eps);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int p = lane + 32 * i;
      if (p < half) {
        const float ya = Num<T>::round(Num<T>::load(w[p]) * Num<T>::round(a[i] * rstd));
        const float yb = Num<T>::round(Num<T>::load(w[p + half]) * Num<T>::round(b[i] * rstd));
        const float c = Num<T>::load(cos_t[pos * d + p]);
        const float s = Num<T>::load(sin_t[pos * d + p]);
        dst[p] = Num<T>::store(Num<T>::round(ya * c) - Num<T>::round(yb * s));
        dst[p + half] = Num<T>::store(Num<T>::round(yb * c) + Num<T>::round(ya * s));
      }
    }
  }
}

extern "C" __global__ void qk_norm_rope_bf16(const bf16_t* q, long long q_st, const bf16_t* k,
                                             long long k_st, const bf16_t* qw, const bf16_t* kw,
                                             const bf16_t* cos_t, const bf16_t* sin_t,
                                             const long long* positions, bf16_t* q_out,
                                             bf16_t* k_out, int hq, int hkv, int d, float eps) {
  qk_norm_rope_impl<bf16_t>(q, q_st, k, k_st, qw, kw, cos_t, sin_t, positions, q_out, k_out, hq,
                            hkv, d, eps);
}

extern "C" __global__ void qk_norm_rope_f32(const float* q, long long q_st, const float* k,
                                            long long k_st, const float* qw, const float* kw,
                                            const float* cos_t, const float* sin_t,
                                            const long long* positions, float* q_out,
                                            float* k_out, int hq, int hkv, int d, float eps) {
  qk_norm_rope_impl<float>(q, q_st, k, k_st, qw, kw, cos_t, sin_t, positions, q_out, k_out, hq,
                           hkv, d, eps);
}
