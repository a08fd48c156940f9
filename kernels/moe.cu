// Qwen3-MoE for small batches: routing, then the chosen experts' SwiGLU MLPs read as GEMVs
// (only the weights of the experts a token picked are read).
//
// moe_route:    logits [N, E] (T) -> weights [N, K] (T), experts [N, K] int64. Softmax in fp32
//               over E <= 256 experts, top K by probability (ties: lower index), renormalised
//               to sum 1 when renorm != 0, then rounded to T. One warp per token.
// moe_gate_up:  x [N, H], gate_up [E, 2I, H] -> act [N, K, I] = T(T(silu(T(x.g))) * T(x.u)).
//               Grid (N*K, ceil(I / 8)), 8 warps, one output column n per warp.
// moe_down:     act [N, K, I], down [E, H, I], weights (+ res [N, H]) -> out [N, H] =
//               T(res + T(sum_k w[n, k] * T(act[n, k] . down[e_k, h]))) (no res: without it).
//               Grid (N, ceil(H / 8)), 8 warps, one output element per warp, the experts'
//               rows four at a time.
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

// Per-lane partial dots of R row pairs (x[r], w[r]) over n elements (16-byte aligned,
// n % Vec<T>::N == 0): every load of an iteration (U 16-byte vectors per operand and row) is
// issued before the FMAs, rows side by side, so a lane keeps 2 R U loads in flight (x rows
// that repeat hit L1); they stay raw until used (register pressure). The caller reduces each
// s[r] over the warp (warp_sum).
template <typename T, int R, int U>
__device__ __forceinline__ void lane_dots(const T* const (&x)[R], const T* const (&w)[R], int n,
                                          float (&s)[R]) {
  constexpr int V = Vec<T>::N;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = 0.f;
  for (int c = lane * V; c < n; c += 32 * U * V) {
    uint4 xv[R][U], wv[R][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool ok = c + 32 * V * u < n;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        xv[r][u] = ok ? *reinterpret_cast<const uint4*>(x[r] + c + 32 * V * u) : uint4{};
        wv[r][u] = ok ? *reinterpret_cast<const uint4*>(w[r] + c + 32 * V * u) : uint4{};
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const T* a = reinterpret_cast<const T*>(&xv[r][u]);
        const T* b = reinterpret_cast<const T*>(&wv[r][u]);
#pragma unroll
        for (int i = 0; i < V; ++i) s[r] = fmaf(Num<T>::load(a[i]), Num<T>::load(b[i]), s[r]);
      }
  }
}

// One warp per output column n of one (token, expert) pair: the gate and up rows side by side.
template <typename T>
__device__ void moe_gate_up_impl(const T* __restrict__ x, const T* __restrict__ gate_up,
                                 const long long* __restrict__ experts, T* __restrict__ act,
                                 int top_k, int hidden, int inter) {
  const long long pair = blockIdx.x;  // token * top_k + k
  const long long tok = pair / top_k;
  const int n = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= inter) return;
  const long long e = experts[pair];
  const T* wg = gate_up + (e * 2 * inter + n) * (long long)hidden;
  const T* const xs[2] = {x + tok * hidden, x + tok * hidden};
  const T* const w[2] = {wg, wg + (long long)inter * hidden};
  float s[2];
  lane_dots<T, 2, 4>(xs, w, hidden, s);
  const float g = Num<T>::round(warp_sum(s[0]));
  const float u = Num<T>::round(warp_sum(s[1]));
  if ((threadIdx.x & 31) == 0)
    act[pair * inter + n] = Num<T>::store(Num<T>::round(g / (1.f + expf(-g))) * u);
}

// One warp per output element (token, h): the top_k experts' rows four at a time, summed in
// expert order; + residual (rounded as torch's residual + moe_out) when res is given.
template <typename T>
__device__ void moe_down_impl(const T* __restrict__ act, const T* __restrict__ down,
                              const long long* __restrict__ experts,
                              const T* __restrict__ weights, const T* __restrict__ res,
                              T* __restrict__ out, int top_k, int hidden, int inter) {
  const long long tok = blockIdx.x;
  const int h = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (h >= hidden) return;
  float acc = 0.f;
  for (int k0 = 0; k0 < top_k; k0 += 4) {
    const T* xs[4];
    const T* w[4];
    long long pair[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // rows past top_k repeat the last one and are not summed
      pair[j] = tok * top_k + min(k0 + j, top_k - 1);
      xs[j] = act + pair[j] * inter;
      w[j] = down + (experts[pair[j]] * hidden + h) * (long long)inter;
    }
    float s[4];
    lane_dots<T, 4, 2>(xs, w, inter, s);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float y = Num<T>::round(warp_sum(s[j]));
      if (k0 + j < top_k) acc += Num<T>::round(y * Num<T>::load(weights[pair[j]]));
    }
  }
  if ((threadIdx.x & 31) == 0) {
    const long long o = tok * hidden + h;
    out[o] = Num<T>::store(res ? Num<T>::load(res[o]) + Num<T>::round(acc) : acc);
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
                                               const T* res, T* out, int top_k, int hidden,     \
                                               int inter) {                                     \
    pdl_trigger();                                                                               \
    pdl_wait();                                                                                  \
    moe_down_impl<T>(act, down, experts, weights, res, out, top_k, hidden, inter);                   \
  }

MOE_ENTRY(bf16, bf16_t)
MOE_ENTRY(f32, float)
