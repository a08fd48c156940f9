// Shared pieces of the skinny-matmul kernels (gemv.cu, gemv_int8.cu, gemv_int4.cu).
//
// y[M, N] = x[M, K] @ W[N, K]^T for M <= 16 rows of activations. Memory-bound: every weight
// byte is read once with 16-byte loads. The arithmetic runs on the tensor cores with
// mma.sync m16n8k16 (bf16 in, fp32 accumulate): a warp takes a TILE of 16 weight rows as the
// A operand and the activations as B (8 columns per n-tile, MT n-tiles), so M = 1..16 costs
// the same instructions and no CUDA-core FMAs.
//
// Fragment trick: the dot product over k does not care about the order of k, so each thread
// feeds its A and B registers from the SAME 16-byte chunk of its weight row and activation
// row. Thread (g = lane / 4, t = lane % 4) loads weight rows g and g + 8 of the tile and
// activation row g (+ 8 * j for n-tile j); the logical k slots (2t, 2t+1, 2t+8, 2t+9) of one
// mma map to 4 physical k's of that chunk, identically for A and B. Results (fp32 C):
// c0, c1 -> (weight row g, activation rows 2t, 2t+1), c2, c3 -> (weight row g + 8, same).
//
// Template parameters: MT n-tiles (1: M <= 8, 2: M <= 16); U sub-steps per loop iteration
// (each thread issues 2U 16-byte weight loads before the first mma: bytes in flight and the
// length of the contiguous run each row gets); PF the L2 256-byte prefetch hint; PRO the
// activation prologue (plain x, or its SwiGLU: below), applied to x chunks as they load, and
// the epilogue bits (a residual, the SwiGLU of the results, the row-scale RMSNorm).
// Launch geometry (template): KSPLIT warps share one tile and split K between them
// (interleaved chunks, so the warps of a block read neighbouring bytes); TPB tiles per block;
// blockDim = 32 * KSPLIT * TPB. The KSPLIT partial sums meet in shared memory.
// No cuda_bf16.h: bf16 values are raw 16-bit patterns moved as 32-bit pairs.
#pragma once
#include "pdl.cuh"

typedef unsigned int u32;
typedef unsigned short u16;

#define GEMV_TILE 16

// Weights are streamed once: skip L1 (no reuse), read-only path. PF: ask L2 to fetch the
// whole 256-byte block around the address (neighbouring loads of the warp then hit L2).
template <bool PF>
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  if (PF)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Programmatic dependent launch (kernels/pdl.cuh): the bf16 and int8 kernels wait for the
// previous kernel before their first load (issuing weight loads before the wait costs them
// 8-12 registers, a block per SM at the tuned bf16 geometries: ptxas, sm_90; L2 prefetches
// instead measured slower, docs/performance.md). The int4 kernel loads its first stage
// before the wait.

// Activations are re-read by every block: keep them cached.
__device__ __forceinline__ uint4 ld_cached(const uint4* p) { return __ldg(p); }

__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

// c[0..3] += A(16x16, bf16) * B(16x8, bf16), fp32 accumulate.
// a0: (row g, k 2t..2t+1) a1: (row g+8, k 2t..) a2: (row g, k 2t+8..) a3: (row g+8, k 2t+8..)
// b0: (k 2t..2t+1, col g)  b1: (k 2t+8.., col g)
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// d = a * 1 + c on bf16 pairs (exact when the result is a small integer).
__device__ __forceinline__ u32 bf16x2_add(u32 a, u32 c) {
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(0x3F803F80u), "r"(c));
  return d;
}

// (a & b) | c and c ^ (a & b) in one instruction each.
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 and_xor(u32 a, u32 b, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Sum the KSPLIT warps' accumulators of each tile; warp ks == 0 of the tile gets the total.
// acc: NACC floats per thread. red: shared, TPB * KSPLIT * NACC * 32 floats.
template <int KSPLIT, int NACC>
__device__ __forceinline__ void reduce_ksplit(float* acc, float* red, int tile_in_block, int ks,
                                              int lane) {
  if (KSPLIT == 1) return;
  float* base = red + (size_t)tile_in_block * KSPLIT * NACC * 32;
  if (ks != 0) {
#pragma unroll
    for (int i = 0; i < NACC; ++i) base[(ks * NACC + i) * 32 + lane] = acc[i];
  }
  __syncthreads();
  if (ks == 0) {
#pragma unroll
    for (int s = 1; s < KSPLIT; ++s)
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[i] += base[(s * NACC + i) * 32 + lane];
  }
}

// -- activation prologue (PRO) -----------------------------------------------------------
// What the kernels multiply is act(x), computed on each 16-byte chunk (8 k) of x as it is
// loaded (no extra pass, no shared-memory copy of x):
//   PRO 0: x itself; x [M, K].
//   PRO 2: SwiGLU, x [M, 2K] (gate columns then up columns): bf16(bf16(silu(g)) * u),
//          silu(g) = g / (1 + expf(-g)) — kernels/swiglu.cu's rounding. The expert kernels'
//          down projection reads the gate|up rows this way (kestrel_rt/cuda/gemv_moe.py).
// The product bf16 * bf16 is exact in fp32, so one fma.rn.bf16x2 (+ -0) rounds it exactly as
// the fp32 multiply then store-rounding of the reference kernel.

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }

// (bf16(lo), bf16(hi)) as one bf16 pair, round to nearest even.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// a * b on bf16 pairs, one rounding.
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ u32 swiglu2(u32 g, u32 u) {
  return bf16x2_mul(pack_bf16(silu(bf16_lo(g)), silu(bf16_hi(g))), u);
}

// PRO, the kernels' template parameter: bits 0-1 the activation prologue (0 plain, 2 SwiGLU),
// bit 2 (+4) the residual epilogue, bit 3 (+8) the SwiGLU epilogue (GLU: W is [gate; up], 2I
// rows, and y = silu(x.gate) * (x.up) [M, I]), bit 4 (+16) the row-scale RMSNorm (RSTD:
// below; bf16 kernels), bit 7 (+128) the greedy choice instead of y (ARGMAX: the bulk bf16
// kernel's epilogue, kernels/gemv_bulk.cu). Helpers take the parts.
#define GEMV_ACT(PRO) ((PRO) & 3)
#define GEMV_RES(PRO) (((PRO) & 4) != 0)
#define GEMV_GLU(PRO) (((PRO) & 8) != 0)
#define GEMV_RSTD(PRO) (((PRO) & 16) != 0)
#define GEMV_ARGMAX(PRO) (((PRO) & 128) != 0)

// The two weight rows thread (g, .) of tile `tile` streams (the mma's rows g and g + 8).
// Plain: rows 16 tile + g and + 8 of W [N, K]. GLU: gate row i = 8 tile + g and its up row
// I + i (N = 2I), so the thread ends up holding both halves of output i. Past the end: the
// last row again (read, never stored).
template <bool GLU>
__device__ __forceinline__ void tile_rows(int tile, int g, int N, int& ra, int& rb) {
  if (GLU) {
    const int half = N >> 1;
    ra = min(8 * tile + g, half - 1);
    rb = half + ra;
  } else {
    ra = min(16 * tile + g, N - 1);
    rb = min(16 * tile + g + 8, N - 1);
  }
}

// Where a thread works: lane (g = lane / 4, t = lane % 4) of warp `warp`, the tile it helps
// with (TPB tiles per block, KSPLIT warps per tile: tib, ks) and the tile's two weight rows
// ra, rb (tile_rows). Every gemv kernel starts from it.
template <int KSPLIT, int TPB, bool GLU>
struct TileThread {
  int lane, g, t, tib, ks, tile, ra, rb;
  __device__ __forceinline__ explicit TileThread(int N) {
    lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    g = lane >> 2;
    t = lane & 3;
    tib = warp / KSPLIT;
    ks = warp % KSPLIT;
    tile = blockIdx.x * TPB + tib;
    tile_rows<GLU>(tile, g, N, ra, rb);
  }
};

// Loads of U sub-steps: the 2U weight vectors (wa, wb: the thread's two rows, nvec 16-byte
// vectors each) and the XPER activation chunks of each weight vector (act(x), see XLoad),
// each sub-step's together (fewer registers than all weights first: ptxas, sm_90).
template <int MT, int U, int XPER, bool PF, class XL>
__device__ __forceinline__ void load_stage(uint4 (&A)[U], uint4 (&B)[U],
                                           uint4 (&X)[U][MT][XPER], const uint4* wa,
                                           const uint4* wb, const XL& xl, int s0, int t,
                                           int nvec) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int v = (s0 + u) * 4 + t;
    const bool ok = v < nvec;
    A[u] = ok ? ld_stream<PF>(wa + v) : zero4();
    B[u] = ok ? ld_stream<PF>(wb + v) : zero4();
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int c = 0; c < XPER; ++c) X[u][j][c] = ok ? xl.load(j, XPER * v + c) : zero4();
  }
}

// The activation-loader policy of all three kernels: load(j, v) is chunk v (8 k) of act(x)
// for activation row g + 8 j of thread (g, t), zero for rows >= M. The caller guards v, the
// same for the 8 lanes of a t-group (PRO 2 shuffles within it).
//
// PRO 2 shares the SwiGLU (an expf and a division per element: ~20 instructions) among the
// t-group instead of each lane computing its own row's 8 elements while the lanes of absent
// rows idle (at M = 1 that put ~8x the issue slots of the weight stream on the SwiGLU). In
// round q, lane (g, t) computes word g % 4 (two elements) of row 8j + 2q + g / 4 and the
// owners of those two rows gather their 4 words by shuffles: ceil(rows / 2) rounds of 2
// elements per lane instead of 8 elements.
template <int PRO, int MT>
struct XLoad {
  const uint4* row[MT];  // chunk 0 of the row (PRO 0)
  bool ok[MT];           // row < M
  const u32* xw;         // PRO 2: x as bf16 pairs [M, K] (a row: K / 2 gate, K / 2 up words)
  int kv, rows_m, g, t;  // PRO 2: chunks per K half, rows M, this lane's (g, t)

  // x: [M, K] (PRO 2: [M, 2K]). Call after pdl_wait.
  __device__ __forceinline__ void init(const uint4* x, int g, int M, int K) {
    const int kv = K >> 3;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const int m = g + 8 * j;
      ok[j] = m < M;
      row[j] = x + (size_t)(ok[j] ? m : 0) * (PRO == 2 ? 2 * kv : kv);
    }
    xw = reinterpret_cast<const u32*>(x);
    this->kv = kv;
    rows_m = M;
    this->g = g;
    t = threadIdx.x & 3;
  }

  __device__ __forceinline__ uint4 load(int j, int v) const {
    if constexpr (PRO == 2) {
      const unsigned group = 0x11111111u << t;  // the lanes (0..7, t)
      const int rows = min(8, rows_m - 8 * j);    // rows of n-tile j (the same in the warp)
      u32 o[4] = {0u, 0u, 0u, 0u};
      for (int q = 0; 2 * q < rows; ++q) {
        const int r = 8 * j + 2 * q + (g >> 2);  // the row this lane computes a word of
        u32 val = 0u;
        if (r < rows_m) {
          const u32* p = xw + (size_t)r * (8 * kv) + 4 * v + (g & 3);
          val = swiglu2(__ldg(p), __ldg(p + 4 * kv));
        }
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // row 8j + g: round g / 2, lanes 4 (g % 2) + w
          const u32 got = __shfl_sync(group, val, 4 * (4 * (g & 1) + w) + t);
          if ((g >> 1) == q) o[w] = got;
        }
      }
      return ok[j] ? make_uint4(o[0], o[1], o[2], o[3]) : zero4();
    } else {
      if (!ok[j]) return zero4();
      return ld_cached(row[j] + v);
    }
  }
};

// Write the tile's results: acc[j][0..3] of thread (g, t) are y[2t + 8j + {0,1}][r0 + g (+8)],
// each first multiplied by the row's scale (sa for row g, sb for row g + 8) and rounded to
// bf16. RES: y = bf16(res + that), torch's `res + linear(x)` in bf16; y may alias res (each
// element is read and written by the same thread). A compile-time choice: the residual's code
// costs the kernels without one up to 12 registers (ptxas, sm_90), hence occupancy.
template <int MT, bool RES>
__device__ __forceinline__ void store_tile(u16* y, const u16* res, const float (*acc)[4], int r0,
                                           int g, int t, int M, int N, float sa, float sb) {
#pragma unroll
  for (int j = 0; j < MT; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int m = 8 * j + 2 * t + (c & 1);
      const int r = r0 + g + (c >> 1) * 8;
      if (m < M && r < N) {
        const size_t i = (size_t)m * N + r;
        u16 v = f32_to_bf16(acc[j][c] * (c >> 1 ? sb : sa));
        if constexpr (RES) v = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(v));
        y[i] = v;
      }
    }
  }
}

// GLU epilogue: y[m, i] = bf16(bf16(silu(gate)) * up) with gate = bf16(acc[j][c] * sa), up =
// bf16(acc[j][c + 2] * sb) (rows g and g + 8 of the tile, see tile_rows), i = 8 tile + g:
// the rounding of TorchBackend.swiglu(linear(x)). y [M, N / 2].
template <int MT>
__device__ __forceinline__ void store_glu(u16* y, const float (*acc)[4], int tile, int g, int t,
                                          int M, int N, float sa, float sb) {
  const int half = N >> 1;
  int i;  // an opaque copy: the compiler then keeps no store address live across the K loop
  asm volatile("mov.b32 %0, %1;" : "=r"(i) : "r"(8 * tile + g));  // (bf16 gate_up: 64 not 76 regs)
  if (i >= half) return;
#pragma unroll
  for (int j = 0; j < MT; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int m = 8 * j + 2 * t + c;
      if (m < M) {
        const float gate = bf16_to_f32(f32_to_bf16(acc[j][c] * sa));
        const float up = bf16_to_f32(f32_to_bf16(acc[j][c + 2] * sb));
        y[(size_t)m * half + i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu(gate))) * up);
      }
    }
  }
}

// The tile's results through the epilogue PRO asks for.
template <int MT, int PRO>
__device__ __forceinline__ void store_out(u16* y, const u16* res, const float (*acc)[4],
                                          int tile, int g, int t, int M, int N, float sa,
                                          float sb) {
  static_assert((PRO & ~(2 | 4 | 8 | 16)) == 0, "PRO: 2 the SwiGLU prologue, + 4 a residual, "
                "+ 8 the SwiGLU epilogue, + 16 the row-scale RMSNorm (ARGMAX: no store)");
  static_assert(!(GEMV_GLU(PRO) && GEMV_RES(PRO)), "a SwiGLU epilogue takes no residual");
  if constexpr (GEMV_GLU(PRO))
    store_glu<MT>(y, acc, tile, g, t, M, N, sa, sb);
  else
    store_tile<MT, GEMV_RES(PRO)>(y, res, acc, tile * GEMV_TILE, g, t, M, N, sa, sb);
}

// PRO + 16 (RSTD, bf16 kernels): an RMSNorm of x whose weight is folded into W at load
// (kestrel_rt/fold.py), applied as a per-row scale of the result: y[m] = rstd[m] (x[m] . W)
// with rstd[m] = rsqrt(mean(x[m]^2) + eps). The sums of squares come from the x chunks each
// thread loads anyway (sum_squares), so x is used as loaded: nothing is added to the
// pipelined loads and there is no block-wide pass over x before the K loop.
__device__ __forceinline__ float sum_squares(uint4 c, float ss) {
  const u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    ss = fmaf(bf16_lo(w[i]), bf16_lo(w[i]), ss);
    ss = fmaf(bf16_hi(w[i]), bf16_hi(w[i]), ss);
  }
  return ss;
}

// tot[j]: acc[j][0..3] then the lane's sum of squares of activation row g + 8j over its
// chunks (t, all K-split warps: after reduce_ksplit). Sums over the row group's 4 lanes, then
// acc[j][c] = tot[j][c] * rstd of its activation row 8j + 2t + (c & 1) (lanes 8t, 8t + 4 hold
// rows 2t, 2t + 1). The whole warp calls it.
template <int MT>
__device__ __forceinline__ void scale_by_rstd(const float (*tot)[5], float (*acc)[4], int t,
                                              int K, float eps) {
#pragma unroll
  for (int j = 0; j < MT; ++j) {
    float ss = tot[j][4];
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    const float r0 = rsqrtf(__shfl_sync(0xffffffffu, ss, 8 * t) / (float)K + eps);
    const float r1 = rsqrtf(__shfl_sync(0xffffffffu, ss, 8 * t + 4) / (float)K + eps);
    acc[j][0] = tot[j][0] * r0;
    acc[j][1] = tot[j][1] * r1;
    acc[j][2] = tot[j][2] * r0;
    acc[j][3] = tot[j][3] * r1;
  }
}
