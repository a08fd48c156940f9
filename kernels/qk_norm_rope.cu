// Per-head RMSNorm of q and k over head_dim, then RoPE (rotate-half, as transformers' Qwen3).
//
// Token t (of B*M, row-major over [B, M]) at position pos = positions[t]; for each head:
//   y  = T(w * T(x * rsqrt(mean(x^2) + eps)))                   (the RMSNorm op's rounding)
//   out[p]        = T(T(y[p] * c) - T(y[p+h] * s))               p < h = D/2,
//   out[p + h]    = T(T(y[p+h] * c) + T(y[p] * s))               c = cos[pos, p], s = sin[pos, p]
// cos/sin: [max_pos, D] tables in T (cos[:, p] == cos[:, p + h], as transformers builds them).
// q: [tokens, Hq, D] with token stride q_st and head stride D (a view of the qkv output is
// fine); k likewise with k_st. Outputs q_out [tokens, Hq, D], k_out [tokens, Hkv, D], dense.
// Grid (tokens, head groups): one warp per (token, head); lane l handles pairs p = l, l + 32,
// ... (D <= 256, D even).
#include "common.cuh"

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
