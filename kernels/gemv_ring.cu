// Persistent skinny matmul for decode (M <= 8 activation rows): y[M, N] = x[M, K] @ W^T with
// bf16 weights, plain x, and the residual or SwiGLU epilogue of gemv_mma.cuh (PRO 0, 4, 8).
// It does gemv.cu's mma arithmetic; what differs from that kernel is how the weights reach
// the registers and how many blocks there are. On sm_90 and later the runtime sends these
// launches to gemv_bulk.cu instead, which streams faster there (docs/performance.md); this
// kernel serves older GPUs (cp.async: sm_80).
//
// Why: at batch 1 a decode step is ~7 dependent kernels per layer. The tuned gemvs launch one
// block per 16-row tile (several waves) and let the next kernel launch only after their K
// loop, so at every boundary DRAM idles while the last loads drain, the next grid launches,
// waits for this one, loads x and only then asks for its first weights. Here:
//   * the grid is one block per SM (the tiles blockIdx.x, + gridDim.x, ... of each block are
//     fixed), and the kernel lets its dependents launch at its top: the next kernels' blocks
//     get onto the SMs while this one streams;
//   * each thread streams its weights through a private ring of S slots in shared memory with
//     cp.async (no registers held by loads in flight: S - 1 items in flight per thread), and
//     fills the first S - 1 slots BEFORE pdl_wait (weights are immutable): while the previous
//     kernels finish, this one already pulls (S - 1) * 32 * 32 * KSPLIT bytes per SM;
//   * x (M rows, <= RING_X_BYTES) is staged in shared memory once per block after the wait.
// The static tile split needs the blocks spread one per SM. Blocks launched early (PDL) are
// placed wherever the running kernels leave room, so two of them could land on one SM, which
// would then stream twice the bytes of the others; the default ring (16, 8) takes 128 KB + x,
// more than half an SM's shared memory, so no two ring blocks ever share an SM (smaller rings
// measured slower: docs/performance.md).
// A ring slot is written and read by the same thread only: cp.async.wait_group is the only
// synchronization it needs. Item i of a thread is sub-step (ks + q KSPLIT) of its block's
// tile number i / per (per = sub-steps of the warp per tile); the KSPLIT warps of the block
// meet in shared memory per tile (reduce_ksplit, double-buffered by tile parity).
#include "ring_stage.cuh"

// 16 bytes global -> shared dst, L2 only, with gemv's 256-byte L2 prefetch hint.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;"
               ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
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

// The K-split sum and the store of tile `tile` (red: the tile's K-split floats,
// double-buffered by the caller; thread (g, t) holds weight rows g, g + 8 of the tile,
// gemv.cu's order); acc zeroed after.
template <int KSPLIT, int PRO>
__device__ __forceinline__ void ring_store(float (&acc)[1][4], float* red, u16* y,
                                           const u16* res, int tile, int g, int t, int ks,
                                           int lane, int M, int N) {
  reduce_ksplit<KSPLIT, 4>(&acc[0][0], red, 0, ks, lane);
  if (ks == 0) store_out<1, PRO>(y, res, acc, tile, g, t, M, N, 1.f, 1.f);
#pragma unroll
  for (int c = 0; c < 4; ++c) acc[0][c] = 0.f;
}

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
               int K, const u16* res) {
  static_assert(GEMV_RING_PRO(PRO), "plain x, a residual or the SwiGLU epilogue");
  constexpr int T = 32 * KSPLIT;
  extern __shared__ uint4 smem[];
  // the K-split sums of two tiles (ring_store), the kernel's only static shared memory
  __shared__ float red[2 * (KSPLIT > 1 ? KSPLIT * 4 * 32 : 1)];
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
  stage_x(xs, x, M, kv, nullptr);
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
    ring_store<KSPLIT, PRO>(acc[0], red + (tt & 1) * KSPLIT * 4 * 32, y, res,
                            blockIdx.x + tt * gridDim.x, g, t, ks, lane, M, N);
  }
}
