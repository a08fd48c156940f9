// Persistent skinny matmul fed by the SM's bulk-copy engine (sm_90): y[M, N] = x[M, K] @ W^T,
// M <= 8, bf16 weights (gemv_bulk_bf16).
//
// One block per SM (grid: the SMs, fewer when there are fewer 16-row tiles), looping over the
// tiles blockIdx.x, + gridDim.x, ...; an item is C bytes of each of a tile's 16 rows, a slot of
// the block's ring 16 such rows (padded). A producer warp (the block's last) issues each item's
// 16 row copies (cp.async.bulk) from one lane, completing on the slot's `full` mbarrier, and
// refills a slot once the WARPS consumer warps have arrived on its `empty` mbarrier; the first
// S items go out before the PDL wait (weights are immutable). Consumer warp w works on columns
// [w C / WARPS, (w + 1) C / WARPS) of every slot row; at a tile's end the consumers' sums meet
// in shared memory (one named barrier of the consumers per tile, double-buffered by tile
// parity) and consumer warp 0 stores. The next kernel may launch at the top, or with
// GEMV_LATE_TRIGGER (the runtime's default) once the producer has issued its last item (its
// exit) and the consumers start on the last S.
// Why: the cp.async ring (gemv_ring.cu) issues two copies per thread per 1 KB of weights and
// streams well below copy speed on the H200; a bulk copy moves a row's C bytes with one
// instruction (docs/performance.md). The producer has a warp of its own: a consumer lane that
// also refilled slots would wait on `empty` beside its own warp's waits on `full`. One lane
// issues all 16 copies: a bulk copy takes warp-uniform operands, so 16 lanes issuing one each
// are serialized by the compiler.
#include "argmax_key.cuh"
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

  // The whole block calls it (a __syncthreads).
  __device__ __forceinline__ void init(const void* smem, unsigned long long* full,
                                       unsigned long long* empty, const void* weights, int N,
                                       int row_bytes_) {
    at = (u32)__cvta_generic_to_shared(smem);
    full0 = (u32)__cvta_generic_to_shared(full);
    empty0 = (u32)__cvta_generic_to_shared(empty);
    if (threadIdx.x < S) {
      mbar_init(full0 + 8 * threadIdx.x, 1);
      mbar_init(empty0 + 8 * threadIdx.x, WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    w = reinterpret_cast<const char*>(weights);
    row_bytes = row_bytes_;
    per = (row_bytes + C - 1) / C;
    const int tiles = (N + 15) >> 4;
    total = (int)blockIdx.x < tiles ? ((tiles - 1 - blockIdx.x) / gridDim.x + 1) * per : 0;
    next = BulkTile();
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
  // The block after its staging of x: true for the producer warp (the block's last), whose
  // lane 0 has then refilled every later item and which leaves (its exit counts as the
  // block's PDL trigger); false for the consumer warps.
  template <class Row>
  __device__ __forceinline__ bool producer_done(Row row, int warp, int lane) {
    if (warp != WARPS) return false;
    if (lane == 0) refill(row);
    return true;
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

// ARGMAX (greedy decoding): the index of the largest bf16-rounded result of each row of x
// over the N weight rows (torch.argmax of the bf16 logits: the first index of the maximum, a
// NaN above every number), with no y. A candidate is one 64-bit key (argmax_key.cuh: the
// largest key is the choice), as in kernels/argmax.cu. Consumer warp 0 keeps each lane's best key
// per result column over the block's tiles; at the block's end they meet in one atomicMax per
// row of x (keys [M], zero before the launch) and the block that arrives last on `count`
// writes the indices (out [M], and host[*parity][M] in pinned host memory when host is not
// null: the host reads it after the launch with no copy on the stream) and zeroes keys and
// count for the next launch (a replayed CUDA graph).
struct ArgmaxOut {
  long long* out;
  long long* host;
  const long long* parity;
  unsigned long long* keys;
  unsigned int* count;
};

// Lane (g, t) of consumer warp 0 after a tile's sums (store_tile's order: acc[c] is row
// 16 tile + g + 8 (c >> 1) of W, result column 2t + (c & 1)): its best keys per column.
__device__ __forceinline__ void argmax_take(unsigned long long* best, const float (&acc)[4],
                                            int tile, int g, int t, int M, int N) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int m = 2 * t + (c & 1), n = tile * GEMV_TILE + g + (c >> 1) * 8;
    if (m < M && n < N) {
      const unsigned long long k = argmax_key(bf16_to_f32(f32_to_bf16(acc[c])), n);
      best[c & 1] = key_max(best[c & 1], k);
    }
  }
}

// Consumer warp 0 at its block's end (the whole warp calls it).
__device__ __forceinline__ void argmax_finish(unsigned long long (&best)[2], const ArgmaxOut& am,
                                              int M, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {  // over g: lanes of the same t
      const unsigned long long o = __shfl_xor_sync(0xffffffffu, best[h], off);
      best[h] = key_max(best[h], o);
    }
  const int t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (lane < 4 && 2 * t + h < M && best[h]) atomicMax(am.keys + 2 * t + h, best[h]);
  __syncwarp();
  unsigned int last = 0;
  if (lane == 0) {
    __threadfence();
    last = atomicAdd(am.count, 1u) == gridDim.x - 1;
  }
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __threadfence();
  if (lane < M) {
    const long long n = argmax_index(atomicExch(am.keys + lane, 0ull));
    am.out[lane] = n;
    if (am.host) am.host[*am.parity * M + lane] = n;
  }
  if (lane == 0) *am.count = 0u;
}

// A tile's end: the WARPS consumer warps' sums (store order already) meet in shared memory,
// consumer warp 0 adds them and stores tile at.tile (store_out; ARGMAX: takes its candidates
// into best), every warp's acc is zeroed and `at` moves to the block's next tile. red:
// 2 * WARPS * 4 * 32 floats, half at.tt % 2.
template <int WARPS, int PRO>
__device__ __forceinline__ void bulk_tile_store(float (&acc)[1][4], float* red, BulkTile& at,
                                                int warp, int lane, u16* y, const u16* res,
                                                int M, int N, const float* rstd = nullptr,
                                                unsigned long long* best = nullptr) {
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
    if constexpr (GEMV_RSTD(PRO))  // rows 2t, 2t + 1 of x: their RMSNorm as a row scale
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[0][c] *= rstd[c & 1];
    if constexpr (GEMV_ARGMAX(PRO))
      argmax_take(best, acc[0], at.tile, lane >> 2, lane & 3, M, N);
    else
      store_out<1, PRO>(y, res, acc, at.tile, lane >> 2, lane & 3, M, N, 1.f, 1.f);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) acc[0][c] = 0.f;
  at.next();
}

// bf16 weights W [N, K]: slot row r holds tile row r (tile_rows: r and r + 8 of thread g =
// r % 8's pair), C bytes (C / 2 k) of it per item; lane (g, t) of consumer warp w multiplies the
// 16-byte vectors t, t + 4, ... of its columns of rows g, g + 8 with x staged once per block
// (stage_x). Slot rows are C + 64 bytes apart: a quarter warp's 16-byte reads (rows g, g + 1,
// four vectors each) then cover the 32 banks once. smem: ring [S][16][C + 64] bytes, then
// xs [M][K / 8] uint4. PRO: plain x, a residual or the SwiGLU epilogue; RSTD (+16, the
// row-scale RMSNorm with eps: x's sums of squares taken as it is staged), alone or with the
// SwiGLU epilogue; ARGMAX (+128, after plain x or RSTD): no y (null), the greedy choice into
// out [M] (and host[*parity][M] when host is not null) through keys [M] and count, zero
// before the launch and left at zero (argmax_finish); other PROs take them null.
template <int WARPS, int S, int C, int PRO>
__global__ void __launch_bounds__(32 * (WARPS + 1), 1)
gemv_bulk_bf16(const uint4* __restrict__ w, const uint4* __restrict__ x, u16* y, int M, int N,
               int K, const u16* res, float eps, long long* am_out, long long* am_host,
               const long long* am_parity, unsigned long long* am_keys, unsigned int* am_count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // bulk copies, mbarrier tx counts
  constexpr int BASE = PRO & ~128;  // what comes before the ARGMAX epilogue
  static_assert(GEMV_RING_PRO(BASE) || BASE == 16 || BASE == 24, "plain x (also with its "
                "row-scale RMSNorm: RSTD), a residual or the SwiGLU epilogue");
  static_assert(!GEMV_ARGMAX(PRO) || BASE == 0 || BASE == 16, "ARGMAX: plain x or RSTD, no "
                "residual, no SwiGLU epilogue");
  constexpr int RS = C + 64, SUB = C / WARPS / 64;  // SUB: 32-k steps per warp and item
  extern __shared__ uint4 smem[];
  __shared__ __align__(8) unsigned long long full[S], empty[S];
  __shared__ float red[2 * WARPS * 4 * 32];
  __shared__ float part[GEMV_RSTD(PRO) ? (WARPS + 1) * 8 : 1];  // RSTD: stage_x's sums
#ifndef GEMV_LATE_TRIGGER
  pdl_trigger();
#endif
  const int kv = K >> 3;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  BulkRing<WARPS, S, C, RS> ring;
  ring.init(smem, full, empty, w, N, 2 * K);
  auto row = [&](int tile, int r) {
    int ra, rb;
    tile_rows<GEMV_GLU(PRO)>(tile, r & 7, N, ra, rb);
    return r & 8 ? rb : ra;
  };
  if (threadIdx.x == 32 * WARPS) ring.prefill(row);
  pdl_wait();  // PDL: x and y only after the previous kernel is done (see pdl.cuh)
  uint4* xs = smem + S * ring.SLOT / 16;
  stage_x<GEMV_RSTD(PRO)>(xs, x, M, kv, part);
  if (ring.producer_done(row, warp, lane)) return;
  float rstd[2] = {1.f, 1.f};  // RSTD: of x rows 2t, 2t + 1 (this lane's result columns)
  if constexpr (GEMV_RSTD(PRO))
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (2 * t + h < M) rstd[h] = staged_rstd<WARPS + 1>(part, 2 * t + h, K, eps);
  const int total = ring.total, per = ring.per, trigger_at = max(total - S, 0);
  if (total == 0) GEMV_TRIGGER_END();
  float acc[2][1][4] = {};
  unsigned long long best[2] = {0ull, 0ull};  // ARGMAX: consumer warp 0's keys per column
  BulkTile at;
  const int col0 = warp * (C / WARPS);  // this warp's first byte of a slot row
  for (int i = 0; i < total; ++i) {
    if (i == trigger_at) GEMV_TRIGGER_END();
    const char* slot = ring.wait(i, reinterpret_cast<const char*>(smem));
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
      bulk_tile_store<WARPS, PRO>(acc[0], red, at, warp, lane, y, res, M, N, rstd, best);
    }
  }
  if constexpr (GEMV_ARGMAX(PRO))
    if (warp == 0) argmax_finish(best, ArgmaxOut{am_out, am_host, am_parity, am_keys, am_count},
                                 M, lane);
#else
  __trap();  // the runtime launches it on sm_90 and later only
#endif
}
