// SwiGLU on a fused gate|up activation: gate_up [rows, 2I] (gate columns then up columns)
// -> out [rows, I] = T(T(silu(gate)) * up), as the torch reference rounds it.
// Grid-stride over elements (or 16-byte vectors when vec != 0: I % Vec<T>::N == 0, aligned).
#include "common.cuh"
#include "pdl.cuh"

template <typename T>
__device__ __forceinline__ float swiglu1(float g, float u) {
  return Num<T>::round(g / (1.f + expf(-g))) * u;
}

template <typename T>
__device__ void swiglu_impl(const T* __restrict__ gu, T* __restrict__ out, long long rows,
                            int inter, int vec) {
  constexpr int V = Vec<T>::N;
  const long long stride = (long long)gridDim.x * blockDim.x;
  if (vec) {
    const int per_row = inter / V;
    const long long total = rows * per_row;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += stride) {
      const long long r = i / per_row;
      const int c = (int)(i - r * per_row) * V;
      float g[V], u[V];
      load_vec(gu + r * 2 * inter + c, g);
      load_vec(gu + r * 2 * inter + inter + c, u);
#pragma unroll
      for (int j = 0; j < V; ++j) g[j] = swiglu1<T>(g[j], u[j]);
      store_vec(out + r * inter + c, g);
    }
  } else {
    const long long total = rows * inter;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += stride) {
      const long long r = i / inter;
      const int c = (int)(i - r * inter);
      const float g = Num<T>::load(gu[r * 2 * inter + c]);
      const float u = Num<T>::load(gu[r * 2 * inter + inter + c]);
      out[i] = Num<T>::store(swiglu1<T>(g, u));
    }
  }
}

extern "C" __global__ void swiglu_bf16(const bf16_t* gu, bf16_t* out, long long rows, int inter,
                                       int vec) {
  pdl_trigger();
  pdl_wait();
  swiglu_impl<bf16_t>(gu, out, rows, inter, vec);
}

extern "C" __global__ void swiglu_f32(const float* gu, float* out, long long rows, int inter,
                                      int vec) {
  pdl_trigger();
  pdl_wait();
  swiglu_impl<float>(gu, out, rows, inter, vec);
}
