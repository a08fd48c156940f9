// RMSNorm with an optional fused residual add, one block per row.
//
//   s   = residual + x            (rounded to T, as the torch reference materialises it)
//   out = w * T(s * rsqrt(mean(s^2) + eps))      (fp32 math, the product rounded to T)
//   res_out = s                   (only when residual is given)
//
// x, residual, out, res_out: [rows, n] contiguous; w: [n]. vec != 0 means n and every base
// pointer allow 16-byte accesses (checked by the caller).
#include "common.cuh"
#include "pdl.cuh"

// One 16-byte vector of the row at i into a: s = residual + x rounded to T (also stored into
// res_out) when residual is given, else x.
template <typename T>
__device__ __forceinline__ void load_sum_vec(const T* __restrict__ x,
                                             const T* __restrict__ residual,
                                             T* __restrict__ res_out, long long i,
                                             float (&a)[Vec<T>::N]) {
  load_vec(x + i, a);
  if (residual) {
    float r[Vec<T>::N];
    load_vec(residual + i, r);
#pragma unroll
    for (int j = 0; j < Vec<T>::N; ++j) a[j] = Num<T>::round(r[j] + a[j]);
    store_vec(res_out + i, a);
  }
}

template <typename T>
__device__ void rmsnorm_row(const T* __restrict__ x, const T* __restrict__ residual,
                            const T* __restrict__ w, T* __restrict__ out,
                            T* __restrict__ res_out, int n, float eps, int vec) {
  __shared__ float red[32];
  constexpr int V = Vec<T>::N;
  const long long row = blockIdx.x;
  x += row * n;
  out += row * n;
  if (residual) {
    residual += row * n;
    res_out += row * n;
  }
  const T* src = residual ? res_out : x;  // second pass re-reads what this thread wrote
  float ss = 0.f;
  if (vec) {
    for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
      float a[V];
      load_sum_vec(x, residual, res_out, i, a);
#pragma unroll
      for (int j = 0; j < V; ++j) ss += a[j] * a[j];
    }
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float a = Num<T>::load(x[i]);
      if (residual) {
        a = Num<T>::round(Num<T>::load(residual[i]) + a);
        res_out[i] = Num<T>::store(a);
      }
      ss += a * a;
    }
  }
  const float rstd = rsqrtf(block_sum(ss, red) / (float)n + eps);
  if (vec) {
    for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
      float a[V], g[V];
      load_vec(src + i, a);
      load_vec(w + i, g);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = g[j] * Num<T>::round(a[j] * rstd);
      store_vec(out + i, a);
    }
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float a = Num<T>::round(Num<T>::load(src[i]) * rstd);
      out[i] = Num<T>::store(Num<T>::load(w[i]) * a);
    }
  }
}

extern "C" __global__ void rmsnorm_bf16(const bf16_t* x, const bf16_t* residual,
                                        const bf16_t* w, bf16_t* out, bf16_t* res_out, int n,
                                        float eps, int vec) {
  pdl_trigger();
  pdl_wait();
  rmsnorm_row<bf16_t>(x, residual, w, out, res_out, n, eps, vec);
}

extern "C" __global__ void rmsnorm_f32(const float* x, const float* residual, const float* w,
                                       float* out, float* res_out, int n, float eps, int vec) {
  pdl_trigger();
  pdl_wait();
  rmsnorm_row<float>(x, residual, w, out, res_out, n, eps, vec);
}
