// Greedy token choice: the index of each row's maximum, as torch.argmax (the first index of
// the maximum; a NaN counts as larger than any number, so the first NaN wins).
//
// x [rows, n] (dense) -> out [rows] int64. Grid (chunks, rows): block (c, r) scans chunk c of
// row r and writes its (value, index) to partial[r * chunks + c]; the row's last block to
// finish (a counter per row, reset by that block so that a replayed CUDA graph finds it at
// zero) reduces the row's partials in chunk order. vec != 0: n % 8 == 0 and x is 16-byte
// aligned, so bf16 rows are read as 16-byte vectors. host_out (or null): pinned host memory
// [2, rows] that the chosen ids are also written to, in half *parity (0 or 1, on the device):
// the host reads them after the launch without a device-to-host copy on the stream, and two
// halves let it read one launch's ids while the next launch writes the other.
#include "common.cuh"
#include "pdl.cuh"

// (value, index) pairs: is a better than b?
__device__ __forceinline__ bool argmax_better(float a, long long ia, float b, long long ib) {
  const bool na = a != a, nb = b != b;
  if (na != nb) return na;
  if (na || a == b) return ia < ib;
  return a > b;
}

template <int THREADS>
__device__ __forceinline__ void argmax_block(float& v, long long& i) {
  __shared__ float sv[THREADS / 32];
  __shared__ long long si[THREADS / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_down_sync(0xffffffffu, v, off);
    const long long oi = __shfl_down_sync(0xffffffffu, i, off);
    if (argmax_better(ov, oi, v, i)) v = ov, i = oi;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sv[warp] = v, si[warp] = i;
  __syncthreads();
  if (warp == 0) {
    v = lane < THREADS / 32 ? sv[lane] : -inf_f();
    i = lane < THREADS / 32 ? si[lane] : 0x7fffffffffffffffll;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_down_sync(0xffffffffu, v, off);
      const long long oi = __shfl_down_sync(0xffffffffu, i, off);
      if (argmax_better(ov, oi, v, i)) v = ov, i = oi;
    }
  }
}

template <typename T, int THREADS>
__device__ void argmax_impl(const T* __restrict__ x, long long* __restrict__ out,
                            float* __restrict__ part_v, long long* __restrict__ part_i,
                            unsigned int* __restrict__ counter, long long* __restrict__ host_out,
                            const long long* __restrict__ parity, int n, int chunk, int vec) {
  constexpr int V = Vec<T>::N;
  const int c = blockIdx.x, r = blockIdx.y, chunks = gridDim.x;
  const T* row = x + (long long)r * n;
  const int lo = c * chunk, hi = min(n, lo + chunk);
  float v = -inf_f();
  long long i = 0x7fffffffffffffffll;
  pdl_trigger();
  pdl_wait();
  if (vec) {  // chunk % V == 0 (the wrapper's choice), so vectors never straddle chunks
    for (int j = lo + threadIdx.x * V; j < hi; j += THREADS * V) {
      float e[V];
      load_vec(row + j, e);
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (argmax_better(e[k], j + k, v, i)) v = e[k], i = j + k;
    }
  } else {
    for (int j = lo + threadIdx.x; j < hi; j += THREADS) {
      const float e = Num<T>::load(row[j]);
      if (argmax_better(e, j, v, i)) v = e, i = j;
    }
  }
  argmax_block<THREADS>(v, i);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part_v[(long long)r * chunks + c] = v;
    part_i[(long long)r * chunks + c] = i;
    __threadfence();
    last = atomicAdd(counter + r, 1u) == (unsigned int)chunks - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  v = -inf_f();
  i = 0x7fffffffffffffffll;
  for (int k = threadIdx.x; k < chunks; k += THREADS) {
    const float pv = __ldcg(part_v + (long long)r * chunks + k);
    const long long pi = __ldcg(part_i + (long long)r * chunks + k);
    if (argmax_better(pv, pi, v, i)) v = pv, i = pi;
  }
  __syncthreads();  // argmax_block's shared memory is reused
  argmax_block<THREADS>(v, i);
  if (threadIdx.x == 0) {
    out[r] = i;
    if (host_out) host_out[*parity * gridDim.y + r] = i;  // seen by the host after the launch
    counter[r] = 0;
  }
}

extern "C" __global__ void __launch_bounds__(256) argmax_bf16(
    const bf16_t* x, long long* out, float* part_v, long long* part_i, unsigned int* counter,
    long long* host_out, const long long* parity, int n, int chunk, int vec) {
  argmax_impl<bf16_t, 256>(x, out, part_v, part_i, counter, host_out, parity, n, chunk, vec);
}

extern "C" __global__ void __launch_bounds__(256) argmax_f32(
    const float* x, long long* out, float* part_v, long long* part_i, unsigned int* counter,
    long long* host_out, const long long* parity, int n, int chunk, int vec) {
  argmax_impl<float, 256>(x, out, part_v, part_i, counter, host_out, parity, n, chunk, vec);
}
