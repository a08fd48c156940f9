// The int4 weight stream's pieces shared by gemv_int4.cu and gemv_ring.cu: where a thread
// reads (Int4Src), one pipeline stage of loads (Int4Stage, int4_load), the dequantizing mma
// math of a stage (int4_math: see gemv_int4.cu's header for the arithmetic) and the shuffle
// that brings a tile's sums to store_out's order (int4_store_order).
#pragma once
#include "gemv_mma.cuh"

// p itself, but opaque to the compiler, which then keeps it in registers rather than
// recomputing it from the kernel's parameters at every use in the loop (ptxas, sm_90).
template <class T>
__device__ __forceinline__ const T* kept(const T* p) {
  asm volatile("mov.b64 %0, %0;" : "+l"(p));
  return p;
}

// Chunk c (8 k) of act(x) for n-tile j: XLoad::load, except that PRO 0 reads row 0 again for
// absent rows (row >= M) instead of zeros: an mma's column of B only reaches the same column
// of C, never stored for those rows, and an unpredicated load needs no zeroing.
template <int PRO, int MT>
__device__ __forceinline__ uint4 x_chunk(const XLoad<PRO, MT>& xl, int j, int c) {
  if constexpr (PRO == 0)
    return ld_cached(xl.row[j] + c);
  else
    return xl.load(j, c);
}

// Where a thread reads (32-bit offsets from the arrays' starts: fewer registers than
// pointers, ptxas sm_90): group grp of its rows a, a + 1 is the 16-byte vector wo + 4 grp of
// q and that + wrow, their zeros word zo + grp zstep, their two fp16 scales (one u32) so +
// grp sstep.
struct Int4Src {
  const uint4* q;
  const u32 *zeros, *scales;
  u32 wo, wrow, zo, zstep, so, sstep;
};

// One pipeline stage: U groups of the thread's two rows (a, b: 32 k of each), the zeros word
// and the scales.
template <int U>
struct Int4Stage {
  uint4 a[U], b[U];
  u32 zw[U], sw[U];
};

// Loads groups s0 .. s0 + U - 1 (past the end: nothing, never used).
template <int U, bool PF>
__device__ __forceinline__ void int4_load(Int4Stage<U>& s, const Int4Src& src, u32 s0,
                                          u32 groups) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const u32 grp = s0 + u;
    if (grp < groups) {
      const u32 w = src.wo + 4 * grp;
      s.a[u] = ld_stream<PF>(src.q + w);
      s.b[u] = ld_stream<PF>(src.q + (w + src.wrow));
      s.zw[u] = __ldg(src.zeros + (src.zo + grp * src.zstep));
      s.sw[u] = __ldg(src.scales + (src.so + grp * src.sstep));
    }
  }
}

// A group's end with the zero point outside the mma chain: cg holds the sums of (128 + q) x of
// the thread's rows a (cg 0, 1) and b (cg 2, 3) for C columns 2t, 2t + 1, s2 the group's sums
// of x for those columns; (128 + z) s2 comes off (zw >> zsh: the rows' zero points) and the
// rows' fp16 scales (sw) multiply what is left into acc: sum (q - z) x * scale. The partial
// sums are ~(128 + z) / |q - z| times the result: fp32 keeps ~1e-5 of it.
__device__ __forceinline__ void int4_group_end(float (&acc)[4], const float (&cg)[4], float2 s2,
                                               u32 zw, u32 zsh, u32 sw) {
  const u32 z1 = and_or(zw >> zsh, 0x000F000Fu, 0x43004300u);  // bf16 128 + z of a | b
  const float za = bf16_lo(z1), zb = bf16_hi(z1);
  const float sa = f16_to_f32((u16)sw), sb = f16_to_f32((u16)(sw >> 16));
  acc[0] = fmaf(sa, fmaf(-za, s2.x, cg[0]), acc[0]);
  acc[1] = fmaf(sa, fmaf(-za, s2.y, cg[1]), acc[1]);
  acc[2] = fmaf(sb, fmaf(-zb, s2.x, cg[2]), acc[2]);
  acc[3] = fmaf(sb, fmaf(-zb, s2.y, cg[3]), acc[3]);
}

// acc += groups s0 .. s0 + U - 1 (those < groups) of the thread's rows (the mma's rows g,
// g + 8) times act(x) (n-tile j: rows 8j + g of thread (g, t)). XS: the zero point comes off
// once per group through the group sums of act(x) (xs, int4_x_sums) instead of through mmas of
// -(128 + z) in the chain: half the mmas, a chain half as long.
template <int MT, int U, bool XS = false, class XL>
__device__ __forceinline__ void int4_math(float (&acc)[MT][4], const Int4Stage<U>& s,
                                          const XL& xl, u32 s0, u32 groups, int t, u32 zsh,
                                          const float2* xs = nullptr) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const u32 grp = s0 + u;
    if (u > 0 && grp >= groups) break;  // the same in the whole warp
    const int c0 = 16 * (int)grp + 4 * t;  // the thread's first x chunk of the group
    const u32 wa[4] = {s.a[u].x, s.a[u].y, s.a[u].z, s.a[u].w};
    const u32 wb[4] = {s.b[u].x, s.b[u].y, s.b[u].z, s.b[u].w};
    // -(128 + zero) of rows a, b, each in both bf16 halves
    const u32 z2 = and_or(s.zw[u] >> zsh, 0x000F000Fu, 0xC300C300u);
    const u32 nza = __byte_perm(z2, 0u, 0x1010), nzb = __byte_perm(z2, 0u, 0x3232);
    float cg[MT][4] = {};  // the group's sum of -(128 + z) x + (128 + q) x, one chain
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint4 xv[MT];  // k 8i..8i+7 of this thread's 32
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        xv[j] = x_chunk(xl, j, c0 + i);
        if constexpr (!XS) {
          mma_bf16(cg[j], nza, nzb, nza, nzb, xv[j].x, xv[j].y);
          mma_bf16(cg[j], nza, nzb, nza, nzb, xv[j].z, xv[j].w);
        }
      }
      u32 pa[4], pb[4];  // 128 + q of k pairs (2p, 2p + 1) of word i, rows a and b
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        pa[p] = and_or(wa[i] >> (4 * p), 0x000F000Fu, 0x43004300u);
        pb[p] = and_or(wb[i] >> (4 * p), 0x000F000Fu, 0x43004300u);
      }
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        mma_bf16(cg[j], pa[0], pb[0], pa[1], pb[1], xv[j].x, xv[j].y);
        mma_bf16(cg[j], pa[2], pb[2], pa[3], pb[3], xv[j].z, xv[j].w);
      }
    }
    if constexpr (XS) {
#pragma unroll
      for (int j = 0; j < MT; ++j)  // C columns 2t, 2t + 1: activation rows 8j + 2t, + 1
        int4_group_end(acc[j], cg[j], xs[grp * (4 * MT) + 4 * j + t], s.zw[u], zsh, s.sw[u]);
    } else {
      const float sa = f16_to_f32((u16)s.sw[u]), sb = f16_to_f32((u16)(s.sw[u] >> 16));
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        acc[j][0] = fmaf(sa, cg[j][0], acc[j][0]);
        acc[j][1] = fmaf(sa, cg[j][1], acc[j][1]);
        acc[j][2] = fmaf(sb, cg[j][2], acc[j][2]);
        acc[j][3] = fmaf(sb, cg[j][3], acc[j][3]);
      }
    }
  }
}

// xs[grp * 4 MT + 4 j + t] = the sums over group grp (128 k) of act(x) rows 8j + 2t and
// 8j + 2t + 1 (float2; absent rows 0), for int4_math<.., XS>: a warp per (group, n-tile),
// its mmas with A all ones reading x as int4_math reads it (the same bf16 values, fp32 sums).
// The whole block of WARPS warps calls it after XLoad::init; a barrier must follow.
template <int MT, int WARPS, class XL>
__device__ __forceinline__ void int4_x_sums(float2* xs, const XL& xl, int groups) {
  constexpr u32 ONES = 0x3F803F80u;  // bf16 (1, 1)
  const int lane = threadIdx.x & 31, t = lane & 3;
  for (int item = threadIdx.x >> 5; item < MT * groups; item += WARPS) {
    const int j = item % MT, grp = item / MT;
    float c[4] = {};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = xl.load(j, 16 * grp + 4 * t + i);
      mma_bf16(c, ONES, ONES, ONES, ONES, v.x, v.y);
      mma_bf16(c, ONES, ONES, ONES, ONES, v.z, v.w);
    }
    if (lane < 4) xs[grp * (4 * MT) + 4 * j + t] = make_float2(c[0], c[1]);
  }
}

// A tile's sums to store_out's order after its K loop: thread (g, t) then holds tile rows g
// (acc[j][0..1]) and g + 8 (acc[j][2..3]); row g was computed by thread (g / 2, t), row g + 8
// by (4 + g / 2, t), as its row a (acc[j][0..1]) or b (acc[j][2..3]) for g even or odd. The
// whole warp calls it.
template <int MT>
__device__ __forceinline__ void int4_store_order(float (&acc)[MT][4], int g, int t) {
  const int from = 4 * (g >> 1) + t;
#pragma unroll
  for (int j = 0; j < MT; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float r0a = __shfl_sync(0xffffffffu, acc[j][e], from);
      const float r0b = __shfl_sync(0xffffffffu, acc[j][e + 2], from);
      const float r8a = __shfl_sync(0xffffffffu, acc[j][e], from + 16);
      const float r8b = __shfl_sync(0xffffffffu, acc[j][e + 2], from + 16);
      acc[j][e] = g & 1 ? r0b : r0a;
      acc[j][e + 2] = g & 1 ? r8b : r8a;
    }
  }
}

// Row a of thread g's two adjacent int4 rows a, a + 1 in a tile (gemv_int4.cu's pairing; past
// the end the last pair again, read, never stored).
template <bool GLU>
__device__ __forceinline__ int int4_row_a(int tile, int g, int N) {
  if (GLU) {
    const int half = N >> 1;
    return min(8 * tile + 2 * (g & 3), half - 2) + (g >= 4 ? half : 0);
  }
  return min(16 * tile + 2 * g, N - 2);
}
