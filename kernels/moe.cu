// Qwen3-MoE for small batches: routing, then the chosen experts' SwiGLU MLPs read as GEMVs
// (only the weights of the experts a token picked are read).
//
// moe_route:    logits [N, E] (T) -> weights [N, K] (T), experts [N, K] int64. Softmax in fp32
//               over E <= 256 experts, top K by probability (ties: lower index), renormalised
//               to sum 1 when renorm != 0, then rounded to T. One warp per token.
// moe_gate_up:  x [N, H], gate_up [E, 2I, H] -> act [N, K, I] = T(T(silu(T(x.g))) * T(x.u)).
//               Grid (N*K, ceil(I / 8)), 8 warps, one output column n per warp.
// moe_down:     act [N, K, I], down [E, H, I], weights -> out [N, H] =
//               T(sum_k w[n, k] * T(act[n, k] . down[e_k, h])). Grid (N, H), one warp per k.
// The GEMVs need H % Vec<T>::N == 0 and I % Vec<T>::N == 0 (16-byte loads, checked by the caller).
#include "common.cuh"
#include "pdl.cuh"

#define MOE_MAX_E 256

template <typename T>
__device__ void moe_route_impl(const T* __restrict__ logits, T* __restrict__ weights,
                               long long* __restrict__ experts, int n_tok, int n_exp, int top_k,
                               int renorm) {
  const int lane = threadIdx.x & 31;
  const long long tok = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (tok >= n_tok) return;
  const T* row = logits + tok * n_exp;
  float v[MOE_MAX_E / 32];
  float mx = -inf_f();
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < n_exp ? Num<T>::load(row[e]) : -inf_f();
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < MOE_MAX_E / 32; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < n_exp ? expf(v[i] - mx) : -1.f;  // -1: not an expert / already taken
    sum += e < n_exp ? v[i] : 0.f;
  }
  sum = warp_sum(sum);
  float picked = 0.f, mine = 0.f;  // lane k keeps the k-th weight
  long long mine_e = 0;
  for (int k = 0; k < top_k; ++k) {
    float best = -1.f;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < MOE_MAX_E / 32; ++i) {
      const int e = lane + 32 * i;
      if (v[i] > best) {
        best = v[i];
        best_e = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ob > best || (ob == best && oe < best_e)) {
        best = ob;
        best_e = oe;
      }
    }
    const float p = best / sum;
    picked += p;
    if (lane == k) {
      mine = p;
      mine_e = best_e;
    }
#pragma unroll
    for (int i = 0; i < MOE_MAX_E / 32; ++i)
      if (lane + 32 * i == best_e) v[i] = -1.f;
  }
  if (lane < top_k) {
    weights[tok * top_k + lane] = Num<T>::store(renorm ? mine / picked : mine);
    experts[tok * top_k + lane] = mine_e;
  }
}

// dot of n elements of a (T) and b (T), both 16-byte aligned, n % Vec<T>::N == 0; warp-wide.
// Four independent 16-byte loads per operand in flight per lane.
template <typename T>
__device__ __forceinline__ float warp_dot(const T* __restrict__ a, const T* __restrict__ b,
                                          int n) {
  constexpr int V = Vec<T>::N;
  const int lane = threadIdx.x & 31;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  int c = lane * V;
  for (; c + 96 * V < n; c += 128 * V) {
    float av[4][V], bv[4][V];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      load_vec(a + c + 32 * V * u, av[u]);
      load_vec(b + c + 32 * V * u, bv[u]);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int i = 0; i < V; ++i) s[u] = fmaf(av[u][i], bv[u][i], s[u]);
  }
  for (; c < n; c += 32 * V) {
    float av[V], bv[V];
    load_vec(a + c, av);
    load_vec(b + c, bv);
#pragma unroll
    for (int i = 0; i < V; ++i) s[0] = fmaf(av[i], bv[i], s[0]);
  }
  return warp_sum((s[0] + s[1]) + (s[2] + s[3]));
}

template <typename T>
__device__ void moe_gate_up_impl(const T* __restrict__ x, const T* __restrict__ gate_up,
                                 const long long* __restrict__ experts, T* __restrict__ act,
                                 int top_k, int hidden, int inter) {
  const long long pair = blockIdx.x;  // token * top_k + k
  const long long tok = pair / top_k;
  const int n = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= inter) return;
  const long long e = experts[pair];
  const T* xr = x + tok * hidden;
  const T* wg = gate_up + (e * 2 * inter + n) * (long long)hidden;
  const T* wu = wg + (long long)inter * hidden;
  const float g = Num<T>::round(warp_dot(xr, wg, hidden));
  const float u = Num<T>::round(warp_dot(xr, wu, hidden));
  if ((threadIdx.x & 31) == 0)
    act[pair * inter + n] = Num<T>::store(Num<T>::round(g / (1.f + expf(-g))) * u);
}

template <typename T>
__device__ void moe_down_impl(const T* __restrict__ act, const T* __restrict__ down,
                              const long long* __restrict__ experts,
                              const T* __restrict__ weights, T* __restrict__ out, int top_k,
                              int hidden, int inter) {
  __shared__ float part[32];  // top_k <= 32
  const long long tok = blockIdx.x;
  const int h = blockIdx.y;
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int k = warp; k < top_k; k += warps) {  // one expert's row per warp, all in flight
    const long long pair = tok * top_k + k;
    const long long e = experts[pair];
    const float y = Num<T>::round(
        warp_dot(act + pair * inter, down + (e * hidden + h) * (long long)inter, inter));
    if ((threadIdx.x & 31) == 0) part[k] = Num<T>::round(y * Num<T>::load(weights[pair]));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float acc = 0.f;
    for (int k = 0; k < top_k; ++k) acc += part[k];
    out[tok * hidden + h] = Num<T>::store(acc);
  }
}

#define MOE_ENTRY(SUFFIX, T)                                                                    \
  extern "C" __global__ void moe_route_##SUFFIX(const T* logits, T* weights, long long* experts, \
                                                int n_tok, int n_exp, int top_k, int renorm) {  \
    pdl_trigger();                                                                               \
    pdl_wait();                                                                                  \
    moe_route_impl<T>(logits, weights, experts, n_tok, n_exp, top_k, renorm);                   \
  }                                                                                             \
  extern "C" __global__ void moe_gate_up_##SUFFIX(const T* x, const T* gate_up,                \
                                                  const long long* experts, T* act, int top_k,  \
                                                  int hidden, int inter) {                      \
    pdl_trigger();                                                                               \
    pdl_wait();                                                                                  \
    moe_gate_up_impl<T>(x, gate_up, experts, act, top_k, hidden, inter);                        \
  }                                                                                             \
  extern "C" __global__ void moe_down_##SUFFIX(const T* act, const T* down,                     \
                                               const long long* experts, const T* weights,      \
                                               T* out, int top_k, int hidden, int inter) {      \
    pdl_trigger();                                                                               \
    pdl_wait();                                                                                  \
    moe_down_impl<T>(act, down, experts, weights, out, top_k, hidden, inter);                   \
  }

MOE_ENTRY(bf16, bf16_t)
MOE_ENTRY(f32, float)
