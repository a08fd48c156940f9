// Qwen3-MoE for small batches: routing, then the chosen experts' SwiGLU MLPs read as GEMVs
// (only the weights of the experts a token picked are read).
//
// moe_route:    logits [N, E] (T) -> weights [N, K] (T), experts [N, K] int64. Softmax in fp32
//               over E <= 256 experts, top K by probability (ties: lower index), renormalised
//               to sum 1 when renorm != 0, then rounded to T. One warp per token.
// moe_gate_up:  x [N, H], gate_up [E, 2I, H] -> act [N, K, I] = T(T(silu(T(x.g))) * T(x.u)).
//               Grid (N*K, ceil(I / 8)), 8 warps, one output column n per warp. eps >= 0:
//               x's RMSNorm with a unit weight (folded into gate_up: kestrel_rt/fold.py) as
//               a row scale, T(rstd x.g) and T(rstd x.u), rstd = rsqrt(mean(x^2) + eps).
// moe_down:     act [N, K, I], down [E, H, I], weights (+ res [N, H]) -> out [N, H] =
//               T(res + T(sum_k w[n, k] * T(act[n, k] . down[e_k, h]))) (no res: without it).
//               Grid (N, ceil(H / 8)), 8 warps, one output element per warp, the experts'
//               rows MOE_ROWS at a time.
// Both GEMVs: a block stages its token's activations (x, or act [K, I]) in shared memory once
// (cp.async, after pdl_wait); each lane issues all its weight loads of a chunk of columns
// before the first FMA (one DRAM round trip per chunk; Qwen3-30B-A3B bf16: one chunk), then
// the warp reduces its rows together (warp_sum_rows). Rows past K and columns past H or I are
// predicated off, not loaded. The fp32 dot products' summation order is not the reference's.
// The GEMVs need H % Vec<T>::N == 0 and I % Vec<T>::N == 0 and 16-byte aligned x (16-byte
// loads, checked by the caller).
#include "common.cuh"
#include "pdl.cuh"

#define MOE_MAX_E 256
#define MOE_ROWS 8      // experts a moe_down warp reads at once (a power of two, <= 32)
#define MOE_THREADS 256  // block size of moe_gate_up and moe_down

// One warp routes token tok (logits [N, E]; lane = threadIdx.x & 31); lane k < top_k then
// calls keep(weight k in fp32, renormalised when renorm != 0, expert k).
template <typename T, typename Keep>
__device__ __forceinline__ void route_token(const T* logits, long long tok, int lane, int n_exp,
                                            int top_k, int renorm, Keep keep) {
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
  if (lane < top_k) keep(renorm ? mine / picked : mine, mine_e);
}

// One warp per token. (logits is not __restrict__: plain global loads, not .nc.)
template <typename T>
__device__ void moe_route_impl(const T* logits, T* __restrict__ weights,
                               long long* __restrict__ experts, int n_tok, int n_exp, int top_k,
                               int renorm) {
  const int lane = threadIdx.x & 31;
  const long long tok = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (tok >= n_tok) return;
  route_token<T>(logits, tok, lane, n_exp, top_k, renorm, [&](float w, long long e) {
    weights[tok * top_k + lane] = Num<T>::store(w);
    experts[tok * top_k + lane] = e;
  });
}

// 16-byte weight load when ok (else zero), not kept in L1 (each weight is read once; the
// activations sit in shared memory). Predicated inside the asm: no branch per load. Not .nc:
// ptxas sank gate_up's .nc loads below the __syncthreads, between the FMAs (a round trip
// each); plain loads stay above it, all issued before the first FMA (nvcc 13, sm_90 SASS).
__device__ __forceinline__ uint4 ld_weight(const void* p, bool ok) {
  uint4 r = {0u, 0u, 0u, 0u};
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n}"
      : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
      : "l"(p), "r"((int)ok));
  return r;
}

// A warp's chunk of R weight rows: lane l holds, of each row r, the U 16-byte vectors at
// columns c0 + (32 u + l) V (V = Vec<T>::N), so a chunk spans W = 32 U V columns.

// Issue every load of the chunk at column c0 of rows w[r], r < rows (columns < n); the other
// vectors are zero, not loaded.
template <typename T, int R, int U>
__device__ __forceinline__ void load_rows(uint4 (&wv)[R][U], const T* const (&w)[R], int rows,
                                          int c0, int n) {
  constexpr int V = Vec<T>::N;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + (32 * u + lane) * V;
      wv[r][u] = ld_weight(w[r] + c, r < rows && c < n);
    }
}

// 16 bytes global -> shared without passing through registers (cp.async); zeros when !ok
// (src-size 0: nothing is read). Completed by cp_async_wait_all.
// (Below sm_80: a plain copy through registers.)
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  *reinterpret_cast<uint4*>(dst) = ok ? *reinterpret_cast<const uint4*>(src) : uint4{0u, 0u, 0u, 0u};
#else
  asm volatile(
      "{\n .reg .u64 a;\n .reg .u32 s;\n cvta.to.shared.u64 a, %0;\n cvt.u32.u64 s, a;\n"
      " cp.async.cg.shared.global [s], [%1], 16, %2;\n}"
      :: "l"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// The whole block (MOE_THREADS threads) copies columns [c0, c0 + W) of the rows
// src + r * stride, r < rows (columns < n), into xs [R, W]; the rest of xs is zeroed. All
// copies are in flight at once; callers __syncthreads before (xs free) and after.
template <typename T, int R, int U>
__device__ __forceinline__ void stage_rows(T* xs, const T* src, long long stride, int rows,
                                           int c0, int n) {
  constexpr int V = Vec<T>::N, VR = 32 * U;  // vectors per row of xs
#pragma unroll
  for (int i = 0; i < (R * VR + MOE_THREADS - 1) / MOE_THREADS; ++i) {
    const int f = threadIdx.x + i * MOE_THREADS;
    const int r = f / VR, c = c0 + (f % VR) * V;
    const bool ok = r < rows && c < n;
    if (f < R * VR) cp_async16(xs + f * V, ok ? src + r * stride + c : src, ok);
  }
  cp_async_wait_all();
}

// s[r] += this lane's share of wv[r] . xs[XR == 1 ? 0 : r] (xs [XR, W] in shared memory).
template <typename T, int R, int XR, int U>
__device__ __forceinline__ void dot_rows(const uint4 (&wv)[R][U], const T* xs, float (&s)[R]) {
  constexpr int V = Vec<T>::N, W = 32 * U * V;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4 xv = reinterpret_cast<const uint4*>(xs + (XR == 1 ? 0 : r) * W)[32 * u + lane];
      const T* a = reinterpret_cast<const T*>(&xv);
      const T* b = reinterpret_cast<const T*>(&wv[r][u]);
#pragma unroll
      for (int i = 0; i < V; ++i) s[r] = fmaf(Num<T>::load(a[i]), Num<T>::load(b[i]), s[r]);
    }
}

// One warp per output column n of one (token, expert) pair: the gate and up rows side by side,
// all their loads of a chunk in flight at once; x [H] of the token staged in shared memory.
template <typename T, int U>
__device__ void moe_gate_up_impl(const T* __restrict__ x, const T* __restrict__ gate_up,
                                 const long long* __restrict__ experts, T* __restrict__ act,
                                 int top_k, int hidden, int inter, float eps) {
  constexpr int W = 32 * U * Vec<T>::N;
  __shared__ __align__(16) T xs[W];  // x[tok, c0 : c0 + W]
  const int lane = threadIdx.x & 31;
  const long long pair = blockIdx.x;  // token * top_k + k
  const long long tok = pair / top_k;
  const int n = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const bool live = n < inter;  // a warp past I still stages and syncs
  const long long e = experts[pair];
  const T* wg = gate_up + (e * 2 * inter + (live ? n : 0)) * (long long)hidden;
  const T* const w[2] = {wg, wg + (long long)inter * hidden};
  float s[2] = {0.f, 0.f}, ss = 0.f;  // ss: the lane's sum of x^2 (eps >= 0)
  for (int c0 = 0; c0 < hidden; c0 += W) {
    uint4 wv[2][U];
    load_rows<T, 2, U>(wv, w, live ? 2 : 0, c0, hidden);
    if (c0) __syncthreads();  // the previous chunk of xs is read
    stage_rows<T, 1, U>(xs, x + tok * hidden, 0, 1, c0, hidden);
    __syncthreads();
    dot_rows<T, 2, 1, U>(wv, xs, s);
    if (eps >= 0.f) {  // columns past H were staged as zeros
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint4 xv = reinterpret_cast<const uint4*>(xs)[32 * u + lane];
        const T* a = reinterpret_cast<const T*>(&xv);
#pragma unroll
        for (int i = 0; i < Vec<T>::N; ++i) ss = fmaf(Num<T>::load(a[i]), Num<T>::load(a[i]), ss);
      }
    }
  }
  const float scale = eps >= 0.f ? rsqrtf(warp_sum(ss) / (float)hidden + eps) : 1.f;
  const float gu = warp_sum_rows<2>(s);  // lanes 0-15: x.g, 16-31: x.u
  const float g = Num<T>::round(scale * __shfl_sync(0xffffffffu, gu, 0));
  const float u = Num<T>::round(scale * __shfl_sync(0xffffffffu, gu, 16));
  if (live && lane == 0)
    act[pair * inter + n] = Num<T>::store(Num<T>::round(g / (1.f + expf(-g))) * u);
}

// The warp's chunk at column c0 of the rows of experts k0 .. k0 + rows (lane r < rows holds
// expert k0 + r in my_e) of down [E, H, I], at output h: load_rows of those rows.
template <typename T, int U>
__device__ __forceinline__ void load_down_rows(uint4 (&wv)[MOE_ROWS][U], const T* down,
                                               long long my_e, int rows, bool live, int h,
                                               int hidden, int inter, int c0) {
  const T* w[MOE_ROWS];  // rebuilt per chunk: 8 live pointers would cost 16 registers
#pragma unroll
  for (int r = 0; r < MOE_ROWS; ++r)
    w[r] = down + (__shfl_sync(0xffffffffu, my_e, r) * hidden + (live ? h : 0)) *
                      (long long)inter;
  load_rows<T, MOE_ROWS, U>(wv, w, live ? rows : 0, c0, inter);
}

// One warp per output element (token, h): the rows of MOE_ROWS experts at a time, all their
// loads of a chunk in flight at once; act [top_k, I] of the token staged in shared memory.
// Summed in expert order; + residual (rounded as torch's residual + moe_out) when res is given.
// early != 0: the first chunk's weight loads are issued before pdl_wait, while moe_gate_up
// still runs (its last blocks). That reads `experts` before the wait: it was written before
// moe_gate_up passed its own pdl_wait, and moe_gate_up lets this kernel launch only after
// that (MOE_GATE_UP_ENTRY: pdl_trigger after pdl_wait), so it is complete and visible here.
template <typename T, int U>
__device__ void moe_down_impl(const T* __restrict__ act, const T* __restrict__ down,
                              const long long* __restrict__ experts,
                              const T* __restrict__ weights, const T* __restrict__ res,
                              T* __restrict__ out, int top_k, int hidden, int inter, int early) {
  constexpr int R = MOE_ROWS, W = 32 * U * Vec<T>::N;
  __shared__ __align__(16) T xs[R * W];  // act[tok, k0 + r, c0 : c0 + W]
  const int lane = threadIdx.x & 31;
  const long long tok = blockIdx.x;
  const int h = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const bool live = h < hidden;  // a warp past H still stages and syncs
  const long long o = tok * hidden + h;
  uint4 wv[R][U];
  long long my_e = 0;  // lane r < rows: expert k0 + r
  if (early) {
    my_e = lane < min(R, top_k) ? experts[tok * top_k + lane] : 0;
    load_down_rows<T, U>(wv, down, my_e, min(R, top_k), live, h, hidden, inter, 0);
  }
  pdl_wait();
  if (res && live && lane == 0)  // into L1 now, read at the end (no register held meanwhile)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(res + o));
  float acc = 0.f;
  bool first = true;
  for (int k0 = 0; k0 < top_k; k0 += R) {
    const int rows = min(R, top_k - k0);
    const long long pair = tok * top_k + k0 + lane;
    if (k0 || !early) my_e = lane < rows ? experts[pair] : 0;
    const float my_w = lane < rows ? Num<T>::load(weights[pair]) : 0.f;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.f;
    for (int c0 = 0; c0 < inter; c0 += W) {
      if (k0 || c0 || !early)
        load_down_rows<T, U>(wv, down, my_e, rows, live, h, hidden, inter, c0);
      if (!first) __syncthreads();  // the previous chunk of xs is read
      first = false;
      stage_rows<T, R, U>(xs, act + (tok * top_k + k0) * inter, inter, rows, c0, inter);
      __syncthreads();
      dot_rows<T, R, R, U>(wv, xs, s);
    }
    const float y = warp_sum_rows<R>(s);  // lane l: expert k0 + l / (32 / R)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float yr = Num<T>::round(__shfl_sync(0xffffffffu, y, r * (32 / R)));
      const float wr = __shfl_sync(0xffffffffu, my_w, r);
      if (r < rows) acc += Num<T>::round(yr * wr);
    }
  }
  if (live && lane == 0)
    out[o] = Num<T>::store(res ? Num<T>::load(res[o]) + Num<T>::round(acc) : acc);
}

#define MOE_ROUTE_ENTRY(SUFFIX, T)                                                              \
  extern "C" __global__ void moe_route_##SUFFIX(const T* logits, T* weights, long long* experts, \
                                                int n_tok, int n_exp, int top_k, int renorm) {  \
    pdl_trigger();                                                                               \
    pdl_wait();                                                                                  \
    moe_route_impl<T>(logits, weights, experts, n_tok, n_exp, top_k, renorm);                   \
  }

#define MOE_GATE_UP_ENTRY(SUFFIX, T, U)                                                         \
  extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2)                                  \
      moe_gate_up_##SUFFIX##_u##U(const T* x, const T* gate_up, const long long* experts,      \
                                  T* act, int top_k, int hidden, int inter, float eps) {        \
    pdl_wait();                                                                                  \
    pdl_trigger(); /* after the wait: moe_down may read experts before its own (moe_down_impl) */ \
    moe_gate_up_impl<T, U>(x, gate_up, experts, act, top_k, hidden, inter, eps);                \
  }

#define MOE_DOWN_ENTRY(SUFFIX, T, U)                                                            \
  extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2)                                  \
      moe_down_##SUFFIX##_u##U(const T* act, const T* down, const long long* experts,          \
                               const T* weights, const T* res, T* out, int top_k, int hidden,   \
                               int inter, int early) {                                          \
    pdl_trigger();                                                                               \
    moe_down_impl<T, U>(act, down, experts, weights, res, out, top_k, hidden, inter, early);    \
  }

// U: 16-byte vectors per lane and row of a chunk; the host (kestrel_rt/cuda/ops.py) takes the
// smallest instantiation that covers a row, else the largest (several chunks). The largest
// are the most that fit 128 registers (2 blocks of 256 threads per SM; ptxas -v, sm_90):
// bf16 without spilling (gate_up u8: 96 registers, down u3: 128); f32 down u2 spills a few
// bytes (u3: more), and gate_up at 3 blocks per SM (80 registers) spills from u8 on.
#define MOE_ENTRIES(SUFFIX, T)                                                                  \
  MOE_ROUTE_ENTRY(SUFFIX, T)                                                                    \
  MOE_GATE_UP_ENTRY(SUFFIX, T, 1) MOE_GATE_UP_ENTRY(SUFFIX, T, 2)                               \
  MOE_GATE_UP_ENTRY(SUFFIX, T, 4) MOE_GATE_UP_ENTRY(SUFFIX, T, 8)                               \
  MOE_DOWN_ENTRY(SUFFIX, T, 1) MOE_DOWN_ENTRY(SUFFIX, T, 2)

MOE_ENTRIES(bf16, bf16_t)
MOE_DOWN_ENTRY(bf16, bf16_t, 3)
MOE_ENTRIES(f32, float)
