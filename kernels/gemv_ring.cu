// Persistent skinny matmul for decode (M <= 8 activation rows): y[M, N] = x[M, K] @ W^T with
// bf16 or int4 (AWQ, gemv_int4.cu's layout) weights, plain x or its RMSNorm (done once per
// block as x is staged), and the residual or SwiGLU epilogue of gemv_mma.cuh (PRO 0, 1, 4, 8,
// 9). The bf16 kernel does gemv.cu's mma arithmetic, the int4 one gemv_int4.cu's
// dequantization with the zero point outside the mma chain (int4_item_math); what differs
// from those kernels is how the weights reach the registers and how many blocks there are.
// On sm_90 the bf16 launches go to gemv_bulk.cu instead (Gemv.bulk): this ring streamed at 63%
// of copy on most H200 nodes (NOTES_decode.md, session 9); it stays for older GPUs and int4.
//
// Why: at batch 1 a decode step is ~7 dependent kernels per layer. The tuned gemvs launch one
// block per 16-row tile (several waves) and let the next kernel launch only after their K
// loop, so at every boundary DRAM idles while the last loads drain, the next grid launches,
// waits for this one, loads x and only then asks for its first weights. Here:
//   * the grid is one block per SM (BPS = 1; the tiles blockIdx.x, + gridDim.x, ... of each
//     block are fixed), and the kernel lets its dependents launch at its top: the next
//     kernels' blocks get onto the SMs while this one streams;
//   * each thread streams its weights through a private ring of S slots in shared memory with
//     cp.async (no registers held by loads in flight: S - 1 items in flight per thread), and
//     fills the first S - 1 slots BEFORE pdl_wait (weights are immutable): while the previous
//     kernels finish, this one already pulls (S - 1) * 32 * 32 * KSPLIT bytes per SM;
//   * x (M rows, <= RING_X_BYTES) is staged in shared memory once per block after the wait.
// The static tile split needs the blocks spread one per SM. Blocks launched early (PDL) are
// placed wherever the running kernels leave room, so two of them can land on one SM, which
// then streams twice the bytes of the others: on the H200 a ring of 64 KB per block made the
// qwen3-8b bf16 decode step slower (5.58 ms against 4.50), the default (16, 8): 128 KB + x,
// more than half an SM's shared memory, so no two ring blocks ever share an SM, made it
// faster (4.20 ms; bench/results/NOTES_decode.md, session 7).
// A ring slot is written and read by the same thread only: cp.async.wait_group is the only
// synchronization it needs. Item i of a thread is sub-step (ks + q KSPLIT) of its block's
// tile number i / per (per = sub-steps of the warp per tile); the KSPLIT warps of the block
// meet in shared memory per tile (reduce_ksplit, double-buffered by tile parity).
#include "ring_stage.cuh"

// 16 bytes global -> the shared-window address dst, L2 only, with gemv's 256-byte L2
// prefetch hint; cp_async16 takes a generic pointer to shared memory instead.
__device__ __forceinline__ void cp_async16_at(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  cp_async16_at((u32)__cvta_generic_to_shared(dst), src);
}

// cp.async of 16 (4) bytes to the shared-window address dst when p (predicated, no branch).
__device__ __forceinline__ void cp_async16_if(u32 dst, const void* src, bool p) {
  asm volatile("{ .reg .pred q; setp.ne.b32 q, %2, 0;\n"
               " @q cp.async.cg.shared.global [%0], [%1], 16; }" ::"r"(dst), "l"(src), "r"((int)p)
               : "memory");
}
__device__ __forceinline__ void cp_async4_if(u32 dst, const void* src, bool p) {
  asm volatile("{ .reg .pred q; setp.ne.b32 q, %2, 0;\n"
               " @q cp.async.ca.shared.global [%0], [%1], 4; }" ::"r"(dst), "l"(src), "r"((int)p)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Where the ring's items come from, advanced one item at a time: the tile (blockIdx.x +
// tt gridDim.x), the item's index q among the warp's `per` sub-steps of it, the ring slot.
struct RingCursor {
  int tile, q, slot;
};

template <int S>
__device__ __forceinline__ void ring_advance(RingCursor& c, int per) {
  c.slot = c.slot == S - 1 ? 0 : c.slot + 1;
  if (++c.q == per) {
    c.q = 0;
    c.tile += gridDim.x;
  }
}

// The K-split sum and the store of tile `tile`, the block's tile j of this round (red: the
// round's K-split floats, double-buffered by the caller; thread (g, t) holds weight rows g,
// g + 8 of the tile, gemv.cu's order); acc zeroed after.
template <int KSPLIT, int PRO>
__device__ __forceinline__ void ring_store(float (&acc)[1][4], float* red, int j, u16* y,
                                           const u16* res, int tile, int g, int t, int ks,
                                           int lane, int M, int N) {
  reduce_ksplit<KSPLIT, 4>(&acc[0][0], red, j, ks, lane);
  if (ks == 0) store_out<1, PRO>(y, res, acc, tile, g, t, M, N, 1.f, 1.f, nullptr);
#pragma unroll
  for (int c = 0; c < 4; ++c) acc[0][c] = 0.f;
}

// A ring kernel's static shared memory: the K-split sums of two tiles (ring_store) and the
// RMSNorm partials (stage_x); gemv_variants.ring_static_bytes counts them.
template <int KSPLIT, int PRO>
struct RingShared {
  float red[2 * (KSPLIT > 1 ? KSPLIT * 4 * 32 : 1)];
  float part[GEMV_ACT(PRO) == 1 ? (KSPLIT + 1) * 8 : 1];
};

// Where a ring thread works: lane (g, t) of warp ks; the tiles of its block (mine: blockIdx.x,
// + gridDim.x, ... < ceil(N / 16)); `per`, its warp's items per tile (sub-steps ks, ks +
// KSPLIT, ... < steps); total = mine * per items.
template <int KSPLIT>
struct RingThread {
  int lane, ks, g, t, per, mine, total;
  __device__ __forceinline__ RingThread(int N, int steps) {
    lane = threadIdx.x & 31;
    ks = threadIdx.x >> 5;
    g = lane >> 2;
    t = lane & 3;
    const int tiles = (N + 15) >> 4;
    per = (steps - ks + KSPLIT - 1) / KSPLIT;
    mine = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    total = mine * per;
  }
};

// bf16 weights W [N, K]: a ring item is the thread's 16-byte chunks v = 4 s + t of its two
// weight rows (tile_rows) at sub-step s. smem: ring [S][2][32 KSPLIT] uint4, then xs.
template <int KSPLIT, int S, int PRO>
__global__ void __launch_bounds__(32 * KSPLIT)
gemv_ring_bf16(const uint4* __restrict__ w, const uint4* __restrict__ x, u16* y, int M, int N,
               int K, const u16* res, const uint4* __restrict__ nw, float eps) {
  static_assert(GEMV_RING_PRO(PRO), "plain x or its RMSNorm, a residual or the SwiGLU "
                "epilogue");
  constexpr int T = 32 * KSPLIT;
  extern __shared__ uint4 smem[];
  __shared__ RingShared<KSPLIT, PRO> sh;
  pdl_trigger();  // one wave: the next kernel's blocks may launch now (see the top)
  const int kv = K >> 3;
  const RingThread<KSPLIT> th(N, (kv + 3) >> 2);  // sub-steps of 32 k
  const int lane = th.lane, ks = th.ks, g = th.g, t = th.t;
  const int per = th.per, mine = th.mine, total = th.total;
  uint4* ring = smem;  // slot s: A at [2 s T + tid], B at [(2 s + 1) T + tid]
  uint4* xs = smem + 2 * S * T;
  RingCursor in{(int)blockIdx.x, 0, 0};  // the next item to issue
  const uint4 *wa, *wb;                  // its tile's two rows
  auto rows = [&](int tile) {
    int ra, rb;
    tile_rows<GEMV_GLU(PRO)>(tile, g, N, ra, rb);
    wa = w + (size_t)ra * kv;
    wb = w + (size_t)rb * kv;
  };
  rows(in.tile);
  auto issue = [&](int i) {  // item i into slot in.slot (nothing past the end); one group
    if (i < total) {
      const int v = (ks + in.q * KSPLIT) * 4 + t;
      if (v < kv) {
        cp_async16(ring + 2 * in.slot * T + threadIdx.x, wa + v);
        cp_async16(ring + (2 * in.slot + 1) * T + threadIdx.x, wb + v);
      }
      const int tile = in.tile;
      ring_advance<S>(in, per);
      if (in.tile != tile && i + 1 < total) rows(in.tile);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);  // before the wait: weights only
  pdl_wait();  // PDL: x and y only after the previous kernel is done (see pdl.cuh)
  stage_x<GEMV_ACT(PRO), KSPLIT>(xs, x, nw, eps, M, kv, sh.part);
  float acc[2][1][4] = {};
  int ci = 0, slot = 0;
  for (int tt = 0; tt < mine; ++tt) {
    for (int q = 0; q < per; ++q, ++ci) {
      const int v = (ks + q * KSPLIT) * 4 + t;
      const uint4 X = v < kv ? xs_chunk(xs, g, M, kv, v) : zero4();
      cp_async_wait<S - 2>();  // item ci has landed
      uint4 A = ring[2 * slot * T + threadIdx.x], B = ring[(2 * slot + 1) * T + threadIdx.x];
      if (v >= kv) A = B = zero4();
      issue(ci + S - 1);  // into the slot item ci - 1 used
      slot = slot == S - 1 ? 0 : slot + 1;
      mma_bf16(acc[0][0], A.x, B.x, A.y, B.y, X.x, X.y);
      mma_bf16(acc[1][0], A.z, B.z, A.w, B.w, X.z, X.w);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      acc[0][0][c] += acc[1][0][c];
      acc[1][0][c] = 0.f;
    }
    ring_store<KSPLIT, PRO>(acc[0], sh.red + (tt & 1) * KSPLIT * 4 * 32, 0, y, res,
                            blockIdx.x + tt * gridDim.x, g, t, ks, lane, M, N);
  }
}

// The most 128-k groups of an int4 ring launch: K <= 16384 (RING_X_BYTES at M = 1).
#define RING_MAX_GROUPS 128

// sx[i * 8 + c] = the sum over group i (128 k) of staged x row min(c, M - 1), fp32, for the
// mma's 8 columns c (columns c >= M repeat row M - 1: never stored, always finite). Half a
// warp per group: each lane a chunk, then a shuffle tree. The whole block calls it (one
// __syncthreads).
__device__ __forceinline__ void int4_group_sums(float* sx, const uint4* xs, int M, int kv,
                                                int groups) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int m = 0; m < M; ++m) {
    for (int i0 = 2 * (threadIdx.x >> 5); i0 < groups; i0 += 2 * warps) {
      const int i = i0 + (lane >> 4);  // the same for the whole half warp
      float s = 0.f;
      if (i < groups) {
        const uint4 v = xs[m * kv + 16 * i + (lane & 15)];
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int h = 0; h < 4; ++h) s += bf16_lo(w[h]) + bf16_hi(w[h]);
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if ((lane & 15) == 0 && i < groups) {
        sx[i * 8 + m] = s;
        if (m == M - 1)
          for (int c = M; c < 8; ++c) sx[i * 8 + c] = s;
      }
    }
  }
  __syncthreads();
}

// One ring item of the int4 kernel in registers: the thread's 16-byte vectors of rows a, b
// (32 k each), their zeros word and two fp16 scales, and its four chunks of x for the group.
struct Int4Item {
  uint4 a, b;
  u32 zw, sw;
  uint4 x[4];
};

// acc += one group of the thread's rows a, b (the mma's rows g, g + 8) times act(x), with the
// zero point outside the mma chain: the 8 mmas sum (128 + q) x (gemv_int4.cu's lop3 trick),
// then int4_group_end takes (128 + z) times the group's sums of x off (sp: columns 2t, 2t + 1)
// and scales. Half the mmas of int4_math's default, whose zero-point mmas share the chain. zsh:
// where rows a, b's zero points sit in the zeros word.
__device__ __forceinline__ void int4_item_math(float (&acc)[1][4], const Int4Item& it,
                                               const float* sp, u32 zsh) {
  const u32 wa[4] = {it.a.x, it.a.y, it.a.z, it.a.w};
  const u32 wb[4] = {it.b.x, it.b.y, it.b.z, it.b.w};
  float cg[4] = {};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 pa[4], pb[4];  // 128 + q of k pairs (2p, 2p + 1) of word i, rows a and b
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      pa[p] = and_or(wa[i] >> (4 * p), 0x000F000Fu, 0x43004300u);
      pb[p] = and_or(wb[i] >> (4 * p), 0x000F000Fu, 0x43004300u);
    }
    mma_bf16(cg, pa[0], pb[0], pa[1], pb[1], it.x[i].x, it.x[i].y);
    mma_bf16(cg, pa[2], pb[2], pa[3], pb[3], it.x[i].z, it.x[i].w);
  }
  // columns 2t, 2t + 1 of the result are activation rows 2t, 2t + 1
  int4_group_end(acc[0], cg, *reinterpret_cast<const float2*>(sp), it.zw, zsh, it.sw);
}

// The first weight row of the 8-row half j of a tile (GLU: the gate rows, then the up rows;
// past the end the last 8 rows, read, never stored). N % 8 == 0; GLU: N % 16 == 0.
template <bool GLU>
__device__ __forceinline__ int int4_half_row(int tile, int j, int N) {
  if (GLU) return (j ? N >> 1 : 0) + min(8 * tile, (N >> 1) - 8);
  return min(16 * tile + 8 * j, N - 8);
}

// The int4 ring's per-warp item metadata in shared memory (48 bytes per slot and warp): the
// 16 rows' fp16 scales (scale pair u32 g is rows a, a + 1 of lane g), then the two zeros words
// (word j holds the 8 rows of half j), copied by lanes 0-3: lanes 0, 1 16 bytes of scales
// (half j = lane), lanes 2, 3 4 bytes of zeros (j = lane - 2).
struct Int4Meta {
  static constexpr int WORDS = 12;  // 8 scale pairs, 2 zeros words, 2 padding
  const char* src;  // this lane's piece of the next item (lanes 0-3)
  u32 step;         // bytes per item (KSPLIT groups on)
  u32 dst;          // this lane's piece in slot 0 (shared-window address)
  bool big, small;  // lanes 0, 1 / lanes 2, 3
  template <bool GLU>
  __device__ __forceinline__ void at(const u16* scales, const u32* zeros, int tile, int ks,
                                     int lane, int N) {
    const int row0 = int4_half_row<GLU>(tile, lane & 1, N);
    src = big ? reinterpret_cast<const char*>(scales + (size_t)ks * N + row0)
              : reinterpret_cast<const char*>(zeros + (size_t)ks * (N >> 3) + (row0 >> 3));
  }
  // This lane's piece of the item into its slot: slot_off = the slot's byte offset in the
  // meta array (slot x 16 warps x 48 bytes).
  __device__ __forceinline__ void issue(u32 slot_off) const {
    cp_async16_if(dst + slot_off, src, big);
    cp_async4_if(dst + slot_off, src, small);
  }
};

// int4 weights (q [N, K / 8] kernel layout, AWQ zeros / fp16 scales: gemv_int4.cu), 16 warps:
// TPB = 16 / KSPLIT tiles at a time, KSPLIT warps on each. A ring item is group grp = ks + q
// KSPLIT (128 k) of the thread's rows a, a + 1: two 16-byte vectors in its own slot, and the
// warp's 16 rows' scales and zeros words in the warp's slot (Int4Meta), copied by 4 lanes. The
// zero point comes off through the group sums of x (int4_item_math). smem: A [S][512],
// B [S][512] uint4, meta [S][16][12] u32, then xs (chunks swizzled: x_swizzle).
// Why so (ncu, H200, qwen3-8b gate_up): per weight byte the int4 stream needs ~4x the
// instructions and shared-memory traffic of the bf16 one. The first int4 ring (16 warps on one
// tile) streamed at 35% of copy: the SM's shared-memory pipe was busy with per-thread 4-byte
// copies of zeros / scales (16 wavefronts each) and 2-way conflicting x reads, and at K = 4096
// each warp did 2 groups per tile between the tile's K-split barriers, reductions and
// shuffles (~250 instructions issued per 2048 weights). Now the metadata is copied once per
// warp, x is read conflict-free one item ahead, and with KSPLIT < 16 a warp does 16 / KSPLIT
// times more groups per tile (H200, bench/gemv_bench.py, the 36-layer qwen3-8b int4 stream:
// 35% of copy first, 39% with (16, 8) now, 43% with (8, 8), against 55% for gemv_int4.cu;
// the decode step 2.601 ms with (8, 8) against 2.352: still off by default, NOTES_decode.md
// session 8). Tiles are blockIdx.x, + gridDim.x, ... in sets of TPB; the last set's missing
// tiles are computed from clamped rows and not stored (every warp meets every barrier).
template <int KSPLIT, int S, int PRO>
__global__ void __launch_bounds__(512, 1)
gemv_ring_int4(const uint4* __restrict__ qw, const u32* __restrict__ zeros,
               const u16* __restrict__ scales, const uint4* __restrict__ x, u16* y, int M, int N,
               int K, const u16* res, const uint4* __restrict__ nw, float eps) {
  static_assert(GEMV_RING_PRO(PRO), "plain x or its RMSNorm, a residual or the SwiGLU "
                "epilogue");
  static_assert(S >= 3, "one item in registers, one loading, at least one in flight");
  static_assert(KSPLIT == 4 || KSPLIT == 8 || KSPLIT == 16, "16 warps: TPB = 16 / KSPLIT");
  constexpr int T = 512, TPB = 16 / KSPLIT;
  constexpr bool GLU = GEMV_GLU(PRO);
  extern __shared__ uint4 smem[];
  __shared__ float red[2 * 16 * 4 * 32];  // two rounds' K-split sums (ring_store)
  __shared__ float part[GEMV_ACT(PRO) == 1 ? 17 * 8 : 1];  // stage_x's RMSNorm partials
  __shared__ __align__(16) float sx[RING_MAX_GROUPS * 8];  // int4_group_sums (float2 reads)
  pdl_trigger();  // one wave: the next kernel's blocks may launch now (see the top)
  const int kv = K >> 3, groups = K >> 7;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ks = warp % KSPLIT, j = warp / KSPLIT, g = lane >> 2, t = lane & 3;
  const int tiles = (N + 15) >> 4, sets = (tiles + TPB - 1) / TPB;  // sets of TPB tiles
  const int rounds = blockIdx.x < sets ? (sets - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int per = max(0, (groups - ks + KSPLIT - 1) / KSPLIT);  // the warp's groups per tile
  const int total = rounds * per;
  const int tile0 = blockIdx.x * TPB + j, tstep = gridDim.x * TPB;  // the warp's tiles
  uint4* ra = smem;          // [S][T]
  uint4* rb = smem + S * T;  // [S][T]
  u32* meta = reinterpret_cast<u32*>(smem + 2 * S * T);  // [S][16][Int4Meta::WORDS]
  uint4* xs = smem + 2 * S * T + S * 16 * Int4Meta::WORDS / 4;
  const u32 wrow = (u32)K >> 5;  // 16-byte vectors per row
  // The issue cursor: the next item's slot, tile and index in the tile, and its addresses.
  RingCursor in{tile0, 0, 0};
  const uint4* pq;  // row a's vector of the item (row b: + wrow)
  Int4Meta pm;
  pm.big = lane < 2;
  pm.small = (unsigned)(lane - 2) < 2u;
  pm.step = pm.big ? KSPLIT * N * 2 : KSPLIT * (N >> 3) * 4;
  pm.dst = (u32)__cvta_generic_to_shared(meta + warp * Int4Meta::WORDS) +
           (pm.big ? 16 * lane : 32 + 4 * (lane & 1));
  const u32 a0 = (u32)__cvta_generic_to_shared(ra + threadIdx.x);  // slot 0's A; B: + S T 16
  auto at_tile = [&](int tile) {  // the addresses of group ks of the tile
    pq = qw + ((u32)int4_row_a<GLU>(tile, g, N) * wrow + t + 4 * ks);
    pm.template at<GLU>(scales, zeros, tile, ks, lane, N);
  };
  at_tile(in.tile);
  auto issue = [&](int i) {  // item i into slot in.slot (nothing past the end); one group
    if (i < total) {
      const u32 a = a0 + in.slot * (T * 16);
      cp_async16_at(a, pq);
      cp_async16_at(a + S * T * 16, pq + wrow);
      pm.issue(in.slot * (16 * Int4Meta::WORDS * 4));
      in.slot = in.slot == S - 1 ? 0 : in.slot + 1;
      if (++in.q == per) {
        in.q = 0;
        in.tile += tstep;
        if (i + 1 < total) at_tile(in.tile);
      } else {
        pq += 4 * KSPLIT;
        pm.src += pm.step;
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);  // before the wait: weights only
  pdl_wait();  // PDL: x and y only after the previous kernel is done (see pdl.cuh)
  stage_x<GEMV_ACT(PRO), 16, true>(xs, x, nw, eps, M, kv, part);
  int4_group_sums(sx, xs, M, kv, groups);
  // The thread's x: its mma column g's activation row (row M - 1 for absent rows), chunks
  // 4t + i of each group at swizzled places: i = 0, 1 at xp + tsw, + 1; i = 2, 3 at xp + 2 -
  // tsw, + 1 (x_swizzle(16 grp + 4t + i) = 16 grp + 4t + (i ^ tsw)).
  const int tsw = t & 2;
  const uint4* xrow = xs + min(g, M - 1) * kv + 4 * t;
  const u32 zsh = 2 * ((2 * g) & 7);  // rows a, b's nibbles in the zeros word (a = 2g mod 8)
  // An item's shared-memory reads: slot `slot`, group index q1 of its tile (q1 < per).
  auto load_item = [&](int slot, int q1) {
    const int o = slot * T + threadIdx.x;
    const u32* mw = meta + (slot * 16 + warp) * Int4Meta::WORDS;
    const uint4* xp = xrow + 16 * (ks + q1 * KSPLIT);
    return Int4Item{ra[o], rb[o], mw[8 + (g >> 2)], mw[g],
                    {xp[tsw], xp[1 + tsw], xp[2 - tsw], xp[3 - tsw]}};
  };
  float acc[1][4] = {};
  int ci = 0, slot = 0;
  cp_async_wait<S - 2>();  // item 0 has landed (its metadata: lanes 0-3's copies, then
  __syncwarp();            // the warp barrier shows them to the other lanes)
  Int4Item cur{};
  if (per > 0) cur = load_item(0, 0);
  for (int r = 0; r < rounds; ++r) {
    const int tile = tile0 + r * tstep;
    const float* sp = sx + 8 * ks + 2 * t;
#pragma unroll 2
    for (int q = 0; q < per; ++q, ++ci) {
      cp_async_wait<S - 3>();  // item ci + 1 has landed (or is past the end: unused)
      __syncwarp();
      slot = slot == S - 1 ? 0 : slot + 1;
      const Int4Item nxt = load_item(slot, q + 1 == per ? 0 : q + 1);
      issue(ci + S - 1);  // into the slot of item ci - 1 (in registers since the last step)
      int4_item_math(acc, cur, sp, zsh);
      cur = nxt;
      sp += 8 * KSPLIT;
    }
    int4_store_order<1>(acc, g, t);
    ring_store<KSPLIT, PRO>(acc, red + (r & 1) * 16 * 4 * 32, j, y, res, tile, g, t, ks, lane,
                            M, N);
  }
}
