// The bulk-copy ring of the persistent skinny matmuls (gemv_bulk.cu, bulk_mlp.cu), sm_90:
// mbarrier and 1-D bulk-copy (TMA) primitives, a block's ring of weight slots filled by one
// producer lane (BulkRing), the tile cursor (BulkTile), a tile's end (bulk_tile_store) and the
// bf16 consumers' loop over a matrix's items (bulk_bf16_items). See gemv_bulk.cu's top.
#pragma once
#include "ring_stage.cuh"

// -- mbarrier and bulk-copy (TMA, 1-D) primitives; shared-window addresses -----------------
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also expects `bytes` of bulk copies to complete on the barrier.
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
// bytes (a multiple of 16) global -> shared dst by the SM's bulk-copy engine, completing on bar.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
               "%2, [%3];" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// A place in a block's tiles (tile blockIdx.x, + gridDim.x, ...): item q of tile `tile`, the
// block's tt-th tile. The producer's cursor and each consumer's.
struct BulkTile {
  int q, tile, tt;
  __device__ __forceinline__ BulkTile() : q(0), tile(blockIdx.x), tt(0) {}
  __device__ __forceinline__ void next() {
    q = 0;
    tile += gridDim.x;
    ++tt;
  }
};

// The block's ring: S slots of 16 rows of RS bytes (C of weights each) at the start of the
// dynamic shared memory, their mbarriers, and the producer's cursor (the next item's tile and
// index in it: `next`). `row(tile, r)`: the weight row slot row r holds.
template <int WARPS, int S, int C, int RS>
struct BulkRing {
  static constexpr int SLOT = 16 * RS;
  u32 at, full0, empty0;
  BulkTile next;  // the next item to issue
  int per, row_bytes, total;
  const char* w;

  // A block's items of a weight of N rows of row_bytes: `per` per 16-row tile, `total` over
  // its tiles blockIdx.x, + gridDim.x, ... (the producer's and the consumers' count).
  __device__ __forceinline__ static void items(int N, int row_bytes, int& per, int& total) {
    per = (row_bytes + C - 1) / C;
    const int tiles = (N + 15) >> 4;
    total = (int)blockIdx.x < tiles ? ((tiles - 1 - blockIdx.x) / gridDim.x + 1) * per : 0;
  }
  // The whole block calls it (a __syncthreads).
  __device__ __forceinline__ void init(const void* smem, unsigned long long* full,
                                       unsigned long long* empty) {
    at = (u32)__cvta_generic_to_shared(smem);
    full0 = (u32)__cvta_generic_to_shared(full);
    empty0 = (u32)__cvta_generic_to_shared(empty);
    if (threadIdx.x < S) {
      mbar_init(full0 + 8 * threadIdx.x, 1);
      mbar_init(empty0 + 8 * threadIdx.x, WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
  }
  // The producer's next weight: N rows of row_bytes_ bytes, from its first item.
  __device__ __forceinline__ void start(const void* weights, int N, int row_bytes_) {
    w = reinterpret_cast<const char*>(weights);
    row_bytes = row_bytes_;
    items(N, row_bytes, per, total);
    next = BulkTile();
  }
  __device__ __forceinline__ void init(const void* smem, unsigned long long* full,
                                       unsigned long long* empty, const void* weights, int N,
                                       int row_bytes_) {
    init(smem, full, empty);
    start(weights, N, row_bytes_);
  }
  // Item i into slot i % S (the producer lane).
  template <class Row>
  __device__ __forceinline__ void issue(int i, Row row) {
    const int slot = i % S, off = next.q * C, bytes = min(C, row_bytes - off);
    const u32 bar = full0 + 8 * slot, dst = at + slot * SLOT;
    mbar_expect(bar, 16 * bytes);
#pragma unroll
    for (int r = 0; r < 16; ++r)
      bulk_copy(dst + r * RS, w + (size_t)row(next.tile, r) * row_bytes + off, bytes, bar);
    if (++next.q == per) next.next();
  }
  // The producer before the PDL wait: the first S items.
  template <class Row>
  __device__ __forceinline__ void prefill(Row row) {
    for (int i = 0; i < S && i < total; ++i) issue(i, row);
  }
  // The producer after it: each later item once its slot's consumers are done.
  template <class Row>
  __device__ __forceinline__ void refill(Row row) {
    for (int i = S; i < total; ++i) {
      mbar_wait(empty0 + 8 * (i % S), (u32)(i / S - 1) & 1u);
      issue(i, row);
    }
  }
  // The producer, weights one after another through one ring: every item of the current one
  // (`start`), the ring's item i onwards (i counts on over the weights), each once its slot
  // is free.
  template <class Row>
  __device__ __forceinline__ void produce(int& i, Row row) {
    for (int j = 0; j < total; ++j, ++i) {
      if (i >= S) mbar_wait(empty0 + 8 * (i % S), (u32)(i / S - 1) & 1u);
      issue(i, row);
    }
  }
  // Consumers: item i has landed; its slot's bytes.
  __device__ __forceinline__ const char* wait(int i, const char* ring) const {
    mbar_wait(full0 + 8 * (i % S), (u32)(i / S) & 1u);
    return ring + (i % S) * SLOT;
  }
  // Consumers: this warp is done with item i's slot (the whole warp calls it).
  __device__ __forceinline__ void release(int i, int lane) const {
    __syncwarp();  // every lane's reads of the slot done (their values are in registers)
    if (lane == 0)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty0 + 8 * (i % S))
                   : "memory");
  }
};

// A tile's end: the WARPS consumer warps' sums (store order already) meet in shared memory,
// consumer warp 0 adds them and stores tile at.tile (store_out), every warp's acc is zeroed and
// `at` moves to the block's next tile. red: 2 * WARPS * 4 * 32 floats, half at.tt % 2.
template <int WARPS, int PRO>
__device__ __forceinline__ void bulk_tile_store(float (&acc)[1][4], float* red, BulkTile& at,
                                                int warp, int lane, u16* y, const u16* res,
                                                int M, int N) {
  float* buf = red + (at.tt & 1) * WARPS * 4 * 32;
  if (warp != 0)
#pragma unroll
    for (int c = 0; c < 4; ++c) buf[(warp * 4 + c) * 32 + lane] = acc[0][c];
  asm volatile("bar.sync 1, %0;" ::"r"(32 * WARPS) : "memory");  // the consumers only
  if (warp == 0) {
#pragma unroll
    for (int v = 1; v < WARPS; ++v)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[0][c] += buf[(v * 4 + c) * 32 + lane];
    store_out<1, PRO>(y, res, acc, at.tile, lane >> 2, lane & 3, M, N, 1.f, 1.f, nullptr);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) acc[0][c] = 0.f;
  at.next();
}


// The consumers of a bf16 weight W [N, K] (gemv_bulk_bf16's slot layout): its `total` items
// (`per` per tile) are the ring's items base, base + 1, ...; y [M, N] (store_out's PRO
// epilogue onto res) from act(x) staged in xs [M][K / 8]. The next kernel may launch as item
// trigger_at starts (GEMV_TRIGGER_END; -1: never here). The consumer warps call it.
template <int WARPS, int S, int C, int PRO>
__device__ __forceinline__ void bulk_bf16_items(const BulkRing<WARPS, S, C, C + 64>& ring,
                                                int base, int total, int per, int trigger_at,
                                                const char* smem, const uint4* xs, int kv,
                                                u16* y, const u16* res, float* red, int M,
                                                int N) {
  constexpr int RS = C + 64, SUB = C / WARPS / 64;  // SUB: 32-k steps per warp and item
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  if (total == 0 && trigger_at == 0) GEMV_TRIGGER_END();
  float acc[2][1][4] = {};
  BulkTile at;
  const int col0 = warp * (C / WARPS);  // this warp's first byte of a slot row
  for (int j = 0; j < total; ++j) {
    const int i = base + j;
    if (j == trigger_at) GEMV_TRIGGER_END();
    const char* slot = ring.wait(i, smem);
    const uint4* wa = reinterpret_cast<const uint4*>(slot + g * RS + col0) + t;
    const uint4* wb = reinterpret_cast<const uint4*>(slot + (g + 8) * RS + col0) + t;
    const int v0 = (at.q * C + col0) / 16 + t;  // the thread's first 16-byte vector of the row
#pragma unroll
    for (int s = 0; s < SUB; ++s) {
      const int v = v0 + 4 * s;
      uint4 A = wa[4 * s], B = wb[4 * s];
      const uint4 X = v < kv ? xs_chunk(xs, g, M, kv, v) : zero4();
      if (v >= kv) A = B = zero4();  // past the row's end: bytes no copy wrote
      mma_bf16(acc[0][0], A.x, B.x, A.y, B.y, X.x, X.y);
      mma_bf16(acc[1][0], A.z, B.z, A.w, B.w, X.z, X.w);
    }
    ring.release(i, lane);
    if (++at.q == per) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[0][0][c] += acc[1][0][c];
        acc[1][0][c] = 0.f;
      }
      bulk_tile_store<WARPS, PRO>(acc[0], red, at, warp, lane, y, res, M, N);
    }
  }
}
