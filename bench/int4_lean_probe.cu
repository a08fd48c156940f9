// Probe, not used by the runtime (bench/int4_lean_probe.py; NOTES_decode.md session 14): an
// int4 matrix-vector product built around the mma fragments, to measure how fast a leaner loop
// streams than gemv_int4.cu's (~17 instructions per 32-bit word of weights there).
// y[N] = x[K] . W^T for one row of x, W[n, k] = (q[n, k] - z) * s per (row n, group of 128 k).
//
// Layout (lean_pack in the probe script): q as u32 words [N / 16][K / 64][32 lanes][4]: lane
// (g = lane / 4, t = lane % 4)'s 16-byte vector in chunk c (64 k) of tile T holds its A
// fragments for the chunk's four k16 steps. In word s, nibble p (p = 0..3) is the low and
// nibble 4 + p the high element of mma register a_p (a0: row g, k 2t and 2t + 1 of the step;
// a1: row g + 8, the same k; a2: row g, k 2t + 8 and 2t + 9; a3: row g + 8, those k), so
// and_or(w >> 4p, 0x000F000F, 0x43004300) is a_p as bf16 pairs of 128 + q. A warp's chunk is
// 512 contiguous bytes. meta u32 [N / 16][K / 128][8][2]: (fp16 scale) | (bf16 of 128 + z) << 16
// for rows g and g + 8 of each tile and group.
// x is staged in shared memory as the B fragments (xs: chunk, t, step, (b0, b1)), so a lane
// reads a chunk's four steps with two 16-byte loads (the 8 lanes of one t: a broadcast).
// A warp takes a pair of tiles (32 rows) over K / KS (KS warps per block; a block takes one
// tile pair, or several in turn: persistent); the sum of x over each k16 step comes from one
// mma with A = ones, shared by both tiles, and at each group's end acc += s * (sum (128 + q) x
// - (128 + z) * sum x). STAGES groups of loads are in flight per warp (registers, rotated by
// unrolling: no moves), across the block's tile pairs.
// int4_lean_bulk: the same arithmetic fed by the SM's bulk-copy engine (gemv_bulk.cu's ring):
// one block per SM, an item is IK groups of a tile pair (both tiles' weights and meta: four
// bulk copies, the layout keeps each contiguous), S items in flight per block.
#include "gemv_bulk.cu"  // gemv_mma.cuh, the mbarrier and bulk-copy primitives

struct LeanStage {
  uint4 w[2][2];  // [tile][chunk]
  uint2 m[2];     // [tile]: meta of rows g, g + 8
};

__device__ __forceinline__ void lean_load(LeanStage& st, const uint4* q, const uint2* meta,
                                          u32 grp, u32 chunks, u32 groups) {
  // tile A at q, tile B one tile on (chunks * 32 vectors); group grp = chunks 2 grp, 2 grp + 1
  const uint4* p = q + 64 * grp;
  st.w[0][0] = ld_stream<true>(p);
  st.w[0][1] = ld_stream<true>(p + 32);
  st.w[1][0] = ld_stream<true>(p + 32 * chunks);
  st.w[1][1] = ld_stream<true>(p + 32 * chunks + 32);
  st.m[0] = __ldg(meta + 8 * grp);
  st.m[1] = __ldg(meta + 8 * (grp + groups));
}

__device__ __forceinline__ void lean_step(float (&c)[4], u32 w, u32 b0, u32 b1) {
  const u32 a0 = and_or(w, 0x000F000Fu, 0x43004300u);
  const u32 a1 = and_or(w >> 4, 0x000F000Fu, 0x43004300u);
  const u32 a2 = and_or(w >> 8, 0x000F000Fu, 0x43004300u);
  const u32 a3 = and_or(w >> 12, 0x000F000Fu, 0x43004300u);
  mma_bf16(c, a0, a1, a2, a3, b0, b1);
}

__device__ __forceinline__ void lean_math(float (&acc)[2][4], const LeanStage& st,
                                          const uint4* xs, u32 grp, int t) {
  constexpr u32 ONES = 0x3F803F80u;  // bf16 (1, 1)
  float cq[2][4] = {}, cs[4] = {};
#pragma unroll
  for (int ch = 0; ch < 2; ++ch) {
    const uint4* xp = xs + ((2 * grp + ch) * 4 + t) * 2;
    const uint4 xa = xp[0], xb = xp[1];
    const u32 b[4][2] = {{xa.x, xa.y}, {xa.z, xa.w}, {xb.x, xb.y}, {xb.z, xb.w}};
    const u32 wa[4] = {st.w[0][ch].x, st.w[0][ch].y, st.w[0][ch].z, st.w[0][ch].w};
    const u32 wb[4] = {st.w[1][ch].x, st.w[1][ch].y, st.w[1][ch].z, st.w[1][ch].w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      mma_bf16(cs, ONES, ONES, ONES, ONES, b[s][0], b[s][1]);
      lean_step(cq[0], wa[s], b[s][0], b[s][1]);
      lean_step(cq[1], wb[s], b[s][0], b[s][1]);
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // c0: row g, c2: row g + 8 (x's column 2t)
    const float sg = f16_to_f32((u16)st.m[i].x), s8 = f16_to_f32((u16)st.m[i].y);
    acc[i][0] = fmaf(sg, fmaf(-bf16_hi(st.m[i].x), cs[0], cq[i][0]), acc[i][0]);
    acc[i][2] = fmaf(s8, fmaf(-bf16_hi(st.m[i].y), cs[2], cq[i][2]), acc[i][2]);
  }
}

// -- The fp16 arithmetic (int4_lean's F16), four logic ops per 32-bit word and no shift on the
// integer pipe. fp16 has 10 mantissa bits, so a nibble at bits 4..7 (and 20..23) ORed into the
// pattern of 1024 gives 1024 + 16 q exactly: and_or(w, 0x000F000F, 0x64006400) and
// and_or(w, 0x00F000F0, 0x64006400) are two registers, and the same of w >> 8 (one IMAD.HI,
// the FMA pipe) two more. Word s of lane (g, t) (lean_pack with f16): nibbles 0 / 4 = row g, k 2t /
// 2t + 1 (1024 + q: a0), nibbles 1 / 5 = row g, k 2t + 8 / 2t + 9 (1024 + 16 q: a2), nibbles 2 /
// 6 = row g + 8 (a1), 3 / 7 = row g + 8 (a3). x is staged as fp16 B fragments, b1 (the k of a2,
// a3) divided by 16, all of it by 2^-e where the row's largest |x| needs it (fp16's range; the
// result is scaled back). The zero point comes off in the same fp32 chain through an mma with
// A = -(1024 + z) at a0 / a1's k and -(1024 + 16 z) at a2 / a3's (exact in fp16); the group's
// scale multiplies the chain once. meta u32 [N / 16][K / 128][8][2]: (fp16 scales of rows g,
// g + 8), (fp16 -(1024 + z) of rows g, g + 8).
__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                        u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 prmt(u32 a, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(a), "r"(sel));
  return d;
}

__device__ __forceinline__ u32 fma_f16x2(u32 a, u32 b, u32 c) {
  u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
  u16 a, b;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(a) : "f"(lo));
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(hi));
  return (u32)a | ((u32)b << 16);
}

__device__ __forceinline__ void lean16_math(float (&acc)[2][4], const LeanStage& st,
                                            const uint4* xs, u32 grp, int t) {
  u32 za[2][4];  // the zero chain's A registers of both tiles
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const u32 nz = st.m[i].y, nz16 = fma_f16x2(nz, 0x4C004C00u, 0x73807380u);  // *16 + 15360
    za[i][0] = prmt(nz, 0x1010);
    za[i][1] = prmt(nz, 0x3232);
    za[i][2] = prmt(nz16, 0x1010);
    za[i][3] = prmt(nz16, 0x3232);
  }
  float cq[2][4] = {};
#pragma unroll
  for (int ch = 0; ch < 2; ++ch) {
    const uint4* xp = xs + ((2 * grp + ch) * 4 + t) * 2;
    const uint4 xa = xp[0], xb = xp[1];
    const u32 b[4][2] = {{xa.x, xa.y}, {xa.z, xa.w}, {xb.x, xb.y}, {xb.z, xb.w}};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const u32 ws[4] = {st.w[i][ch].x, st.w[i][ch].y, st.w[i][ch].z, st.w[i][ch].w};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const u32 w = ws[s], w8 = __umulhi(w, 1u << 24);  // w >> 8 on the FMA pipe
        mma_f16(cq[i], and_or(w, 0x000F000Fu, 0x64006400u), and_or(w8, 0x000F000Fu, 0x64006400u),
                and_or(w, 0x00F000F0u, 0x64006400u), and_or(w8, 0x00F000F0u, 0x64006400u),
                b[s][0], b[s][1]);
        mma_f16(cq[i], za[i][0], za[i][1], za[i][2], za[i][3], b[s][0], b[s][1]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    acc[i][0] = fmaf(f16_to_f32((u16)st.m[i].x), cq[i][0], acc[i][0]);
    acc[i][2] = fmaf(f16_to_f32((u16)(st.m[i].x >> 16)), cq[i][2], acc[i][2]);
  }
}

// x staged as the B fragments (xs: chunk, t, step, (b0, b1)). bf16: as it is. F16: as fp16,
// b1 (a2 / a3's k) divided by 16, all of it by 2^-e where the row's largest |x| needs it
// (fp16's largest is 65504; a NaN stays a NaN); returns e (0 for bf16).
template <bool F16, int THREADS>
__device__ __forceinline__ int lean_stage_x(uint4* xs, const u32* __restrict__ x, int K,
                                            float* most) {
  u32* xw = reinterpret_cast<u32*>(xs);
  int e = 0;
  float down = 1.f;
  if constexpr (F16) {
    float m = 0.f;
    for (int i = threadIdx.x; i < (K >> 1); i += THREADS) {
      const u32 v = __ldg(x + i);
      const float a = fabsf(bf16_lo(v)), b = fabsf(bf16_hi(v));
      m = (a > m || a != a) ? a : m;
      m = (b > m || b != b) ? b : m;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float o = __shfl_xor_sync(0xffffffffu, m, off);
      m = (o > m || o != o) ? o : m;
    }
    if ((threadIdx.x & 31) == 0) most[threadIdx.x >> 5] = m;
    __syncthreads();
    m = most[0];
#pragma unroll
    for (int w = 1; w < THREADS / 32; ++w) m = (most[w] > m || most[w] != most[w]) ? most[w] : m;
    if (m >= 32768.f && m <= 3.0e38f) e = (int)((__float_as_uint(m) >> 23) & 0xFF) - 127 - 14;
    down = __uint_as_float((u32)(127 - e) << 23);
  }
  for (int i = threadIdx.x; i < (K >> 1); i += THREADS) {
    // slot i: hi = i & 1 (b0 / b1), s = (i >> 1) & 3, t = (i >> 3) & 3, chunk c = i >> 5
    const int hi = i & 1, s = (i >> 1) & 3, tt = (i >> 3) & 3, c = i >> 5;
    const u32 v = __ldg(x + 32 * c + 8 * s + tt + 4 * hi);
    if constexpr (F16) {
      const float f = hi ? down * 0.0625f : down;
      xw[i] = pack_f16(bf16_lo(v) * f, bf16_hi(v) * f);
    } else {
      xw[i] = v;
    }
  }
  __syncthreads();
  return e;
}

// Register-fed, persistent: block b takes tile pairs b, b + gridDim.x, ... (grid N / 32: one
// each), its KS warps K / KS each; a warp's loads run STAGES groups ahead across its pairs.
// 2 K bytes of dynamic shared memory (xs). N % 32 == 0, K % (128 KS) == 0. F16: the fp16
// layout and arithmetic (lean16_math), else the bf16 ones (lean_math).
template <int KS, int STAGES, bool F16>
__global__ void __launch_bounds__(32 * KS) int4_lean(const uint4* __restrict__ q,
                                                     const uint2* __restrict__ meta,
                                                     const u32* __restrict__ x,
                                                     u16* __restrict__ y, int N, int K) {
  extern __shared__ uint4 xs[];
  __shared__ float red[2][KS * 32];
  __shared__ float most[KS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const u32 chunks = (u32)K >> 6, groups = (u32)K >> 7, per = groups / KS;
  const u32 g0 = warp * per, pairs = (u32)N >> 5;
  const u32 mine = blockIdx.x < pairs ? (pairs - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const u32 total = mine * per;
  // item j of this warp: pair blockIdx.x + (j / per) gridDim.x, group g0 + j % per
  auto load = [&](LeanStage& st, u32 j) {
    const u32 pair = blockIdx.x + (j / per) * gridDim.x, grp = g0 + j % per;
    lean_load(st, q + ((size_t)(2 * pair) * chunks) * 32 + lane,
                    meta + (size_t)(2 * pair) * groups * 8 + g, grp, chunks, groups);
  };
  LeanStage st[STAGES];
#pragma unroll
  for (int i = 0; i < STAGES; ++i)
    if (i < (int)total) load(st[i], i);
  const int e = lean_stage_x<F16, 32 * KS>(xs, x, K, most);
  const float up = __uint_as_float((u32)(127 + e) << 23);
  float acc[2][4] = {};
  for (u32 base = 0; base < total; base += STAGES) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) {
      const u32 j = base + i;
      if (j < total) {
        const u32 grp = g0 + j % per;
        if constexpr (F16)
          lean16_math(acc, st[i], xs, grp, t);
        else
          lean_math(acc, st[i], xs, grp, t);
        if (j + STAGES < total) load(st[i], j + STAGES);
        if (j % per == per - 1) {  // the pair's last group: the warps' sums meet, warp 0 stores
          const u32 pair = blockIdx.x + (j / per) * gridDim.x;
          float* r = red[(j / per) & 1];
          if (t == 0) {
            r[warp * 32 + g] = acc[0][0];
            r[warp * 32 + g + 8] = acc[0][2];
            r[warp * 32 + 16 + g] = acc[1][0];
            r[warp * 32 + 24 + g] = acc[1][2];
          }
          __syncthreads();
          if (warp == 0) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < KS; ++w) v += r[w * 32 + lane];
            y[32 * pair + lane] = f32_to_bf16(v * up);
          }
#pragma unroll
          for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][c] = 0.f;
        }
      }
    }
  }
}

// Persistent: grid = min(SMs, N / 32); WARPS consumer warps and a producer warp (the last).
// Item it of the block: tile pair blockIdx.x + (it / items) gridDim.x, groups (it % items) IK ..
// + IK - 1; consumer warp w takes groups w, w + WARPS, ... of each item. Dynamic shared memory:
// ring [S][ITEM] (tile A's weights, tile B's, A's meta, B's meta), then xs (2 K bytes).
// N % 32 == 0, K % (128 IK) == 0, IK % WARPS == 0.
template <int WARPS, int S, int IK>
__global__ void __launch_bounds__(32 * (WARPS + 1), 1)
int4_lean_bulk(const uint4* __restrict__ q, const uint2* __restrict__ meta,
               const u32* __restrict__ x, u16* __restrict__ y, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int WB = IK * 1024, MB = IK * 64, ITEM = 2 * (WB + MB);
  extern __shared__ uint4 smem[];
  __shared__ __align__(8) unsigned long long full[S], empty[S];
  __shared__ float red[WARPS * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const u32 chunks = (u32)K >> 6, groups = (u32)K >> 7, items = groups / IK;
  const int pairs = N >> 5;
  const int mine = (int)blockIdx.x < pairs ? (pairs - 1 - (int)blockIdx.x) / gridDim.x + 1 : 0;
  const int total = mine * (int)items;
  const u32 ring = (u32)__cvta_generic_to_shared(smem);
  const u32 full0 = (u32)__cvta_generic_to_shared(full);
  const u32 empty0 = (u32)__cvta_generic_to_shared(empty);
  if (threadIdx.x < S) {
    mbar_init(full0 + 8 * threadIdx.x, 1);
    mbar_init(empty0 + 8 * threadIdx.x, WARPS);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  auto issue = [&](int it) {
    const int slot = it % S;
    const u32 pair = blockIdx.x + (it / items) * gridDim.x, ik = it % items;
    const u32 bar = full0 + 8 * slot, dst = ring + slot * ITEM;
    const uint4* wa = q + ((size_t)(2 * pair) * chunks + 2 * ik * IK) * 32;
    const uint2* ma = meta + ((size_t)(2 * pair) * groups + ik * IK) * 8;
    mbar_expect(bar, ITEM);
    bulk_copy(dst, wa, WB, bar);
    bulk_copy(dst + WB, wa + (size_t)chunks * 32, WB, bar);
    bulk_copy(dst + 2 * WB, ma, MB, bar);
    bulk_copy(dst + 2 * WB + MB, ma + (size_t)groups * 8, MB, bar);
  };
  if (threadIdx.x == 32 * WARPS)
    for (int it = 0; it < S && it < total; ++it) issue(it);
  uint4* xs = smem + S * ITEM / 16;
  lean_stage_x<false, 32 * (WARPS + 1)>(xs, x, K, nullptr);
  if (warp == WARPS) {  // the producer: each later item once its slot is free
    if (lane == 0)
      for (int it = S; it < total; ++it) {
        mbar_wait(empty0 + 8 * (it % S), (u32)(it / S - 1) & 1u);
        issue(it);
      }
    return;
  }
  float acc[2][4] = {};
  for (int it = 0; it < total; ++it) {
    const int slot = it % S;
    mbar_wait(full0 + 8 * slot, (u32)(it / S) & 1u);
    const char* item = reinterpret_cast<const char*>(smem) + slot * ITEM;
    const u32 ik = it % items;
#pragma unroll
    for (int j = 0; j < IK / WARPS; ++j) {
      const int loc = warp + j * WARPS;
      LeanStage st;
      const uint4* wa = reinterpret_cast<const uint4*>(item + loc * 1024) + lane;
      st.w[0][0] = wa[0];
      st.w[0][1] = wa[32];
      st.w[1][0] = wa[WB / 16];
      st.w[1][1] = wa[WB / 16 + 32];
      const uint2* mp = reinterpret_cast<const uint2*>(item + 2 * WB + loc * 64) + g;
      st.m[0] = mp[0];
      st.m[1] = mp[MB / 8];
      lean_math(acc, st, xs, ik * IK + loc, t);
    }
    __syncwarp();
    if (lane == 0)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty0 + 8 * slot)
                   : "memory");
    if (ik == items - 1) {  // the tile pair's last item: the warps' sums meet, warp 0 stores
      if (t == 0) {
        red[warp * 32 + g] = acc[0][0];
        red[warp * 32 + g + 8] = acc[0][2];
        red[warp * 32 + 16 + g] = acc[1][0];
        red[warp * 32 + 24 + g] = acc[1][2];
      }
      asm volatile("bar.sync 1, %0;" ::"r"(32 * WARPS) : "memory");
      if (warp == 0) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += red[w * 32 + lane];
        y[32 * (blockIdx.x + (it / items) * gridDim.x) + lane] = f32_to_bf16(v);
      }
      asm volatile("bar.sync 1, %0;" ::"r"(32 * WARPS) : "memory");
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;
    }
  }
#else
  __trap();
#endif
}
