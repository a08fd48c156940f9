// Greedy token choice: the index of each row's maximum, as torch.argmax (the first index of
// the maximum; a NaN counts as larger than any number, so the first NaN wins).
//
// x [rows, n] (dense) -> out [rows] int64. Candidates are 64-bit keys (argmax_key.cuh: the
// largest is the choice, ties and NaNs included). Grid (chunks, rows): block (c, r) scans chunk
// c of row r and writes its largest key to part[r * chunks + c]; the row's last block to finish
// (a counter per row, reset by that block so that a replayed CUDA graph finds it at zero)
// takes the largest of the row's. vec != 0: n % 8 == 0 and x is 16-byte aligned, so bf16 rows
// are read as 16-byte vectors. host_out (or null): pinned host memory
// [2, rows] that the chosen ids are also written to, in half *parity (0 or 1, on the device):
// the host reads them after the launch without a device-to-host copy on the stream, and two
// halves let it read one launch's ids while the next launch writes the other.
#include "argmax_key.cuh"
#include "common.cuh"
#include "pdl.cuh"

// The largest of the block's keys, in thread 0.
template <int THREADS>
__device__ __forceinline__ unsigned long long block_max_key(unsigned long long k) {
  __shared__ unsigned long long sk[THREADS / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) k = key_max(k, __shfl_down_sync(0xffffffffu, k, off));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sk[warp] = k;
  __syncthreads();
  if (warp == 0) {
    k = lane < THREADS / 32 ? sk[lane] : 0ull;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) k = key_max(k, __shfl_down_sync(0xffffffffu, k, off));
  }
  return k;
}

template <typename T, int THREADS>
__device__ void argmax_impl(const T* __restrict__ x, long long* __restrict__ out,
                            unsigned long long* __restrict__ part,
                            unsigned int* __restrict__ counter, long long* __restrict__ host_out,
                            const long long* __restrict__ parity, int n, int chunk, int vec) {
  constexpr int V = Vec<T>::N;
  const int c = blockIdx.x, r = blockIdx.y, chunks = gridDim.x;
  const T* row = x + (long long)r * n;
  const int lo = c * chunk, hi = min(n, lo + chunk);
  unsigned long long key = 0ull;  // below every candidate's
  pdl_trigger();
  pdl_wait();
  if (vec) {  // chunk % V == 0 (the wrapper's choice), so vectors never straddle chunks
    for (int j = lo + threadIdx.x * V; j < hi; j += THREADS * V) {
      float e[V];
      load_vec(row + j, e);
#pragma unroll
      for (int k = 0; k < V; ++k) key = key_max(key, argmax_key(e[k], j + k));
    }
  } else {
    for (int j = lo + threadIdx.x; j < hi; j += THREADS)
      key = key_max(key, argmax_key(Num<T>::load(row[j]), j));
  }
  key = block_max_key<THREADS>(key);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part[(long long)r * chunks + c] = key;
    __threadfence();
    last = atomicAdd(counter + r, 1u) == (unsigned int)chunks - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  key = 0ull;
  for (int k = threadIdx.x; k < chunks; k += THREADS)
    key = key_max(key, __ldcg(part + (long long)r * chunks + k));
  __syncthreads();  // block_max_key's shared memory is reused
  key = block_max_key<THREADS>(key);
  if (threadIdx.x == 0) {
    const long long i = argmax_index(key);
    out[r] = i;
    if (host_out) host_out[*parity * gridDim.y + r] = i;  // seen by the host after the launch
    counter[r] = 0;
  }
}

extern "C" __global__ void __launch_bounds__(256) argmax_bf16(
    const bf16_t* x, long long* out, unsigned long long* part, unsigned int* counter,
    long long* host_out, const long long* parity, int n, int chunk, int vec) {
  argmax_impl<bf16_t, 256>(x, out, part, counter, host_out, parity, n, chunk, vec);
}

extern "C" __global__ void __launch_bounds__(256) argmax_f32(
    const float* x, long long* out, unsigned long long* part, unsigned int* counter,
    long long* host_out, const long long* parity, int n, int chunk, int vec) {
  argmax_impl<float, 256>(x, out, part, counter, host_out, parity, n, chunk, vec);
}
