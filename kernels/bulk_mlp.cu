// A dense layer's attention output and MLP in one persistent launch (sm_90, bf16 weights,
// M <= 8 rows): three skinny matmuls streamed through one bulk-copy ring (bulk_ring.cuh),
//
//   h   = h_in + o @ Wo^T                          (Wo [H, KO])
//   act = silu(n @ Wg^T) * (n @ Wu^T), n = RMSNorm(h) with weight nw   (Wgu = [Wg; Wu] [2I, H])
//   h   = h + act @ Wd^T                           (Wd [H, I])
//
// with the rounding of the three gemv_bulk_bf16 launches it replaces (PRO 4, 9, 4).
// Why: between two launches the weight stream stops; the next kernel's blocks take an SM only
// once the last one's have left it (each holds most of its shared memory), then wait for the
// launch, their first copies and x. Here the producer warp runs on from one weight into the next
// (weights are immutable: it never waits for x, nor for the PDL dependency), so the ring is full
// when the consumers cross a matmul boundary; the consumers meet at a grid barrier there (every
// block's outputs written, then every block stages the next x). One block per SM: the grid
// must be resident at once (Gemv launches at most one block per SM, and the kernel before it
// completes without waiting for this one, so every block gets its SM).
// smem: ring [S][16][C + 64] bytes, then xs [M][max(KO, H, I) / 8] uint4.
#include "bulk_ring.cuh"

// Every block of the grid has arrived (one thread per block calls it, after its block's writes
// and a __threadfence): count only grows, by one per block and barrier, so barrier b of a
// launch is passed once it reaches the next multiple of gridDim.x after this block's own
// arrival (every block of one counter launches with the same grid: BulkMlp keeps one counter
// per grid size). No reset: a CUDA graph replays with the same counter.
__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void grid_barrier(unsigned long long* count) {
#ifdef MLP_NO_BARRIER  // bench/mlp_bench.py: what the barriers cost (wrong results)
  return;
#endif
  const unsigned long long n = gridDim.x;
  unsigned long long old;
  asm volatile("atom.add.release.gpu.global.u64 %0, [%1], 1;" : "=l"(old) : "l"(count)
               : "memory");
  const unsigned long long target = (old / n + 1) * n;
  while (ld_acquire(count) < target) {
  }
  __threadfence();
}

// The consumers between two matmuls: every warp's stores (warp 0 stores a tile) fenced, the
// grid barrier by one lane, then the consumer warps go on together.
template <int WARPS>
__device__ __forceinline__ void consumers_grid_sync(unsigned long long* bar, int warp,
                                                    int lane) {
  __threadfence();
  asm volatile("bar.sync 1, %0;" ::"n"(32 * WARPS) : "memory");
  if (warp == 0 && lane == 0) grid_barrier(bar);
  asm volatile("bar.sync 1, %0;" ::"n"(32 * WARPS) : "memory");
}

template <int WARPS, int S, int C>
__global__ void __launch_bounds__(32 * (WARPS + 1), 1)
bulk_mlp_bf16(const uint4* __restrict__ wo, const uint4* __restrict__ wgu,
              const uint4* __restrict__ wd, const uint4* o, const u16* h_in, u16* h, u16* act,
              const uint4* __restrict__ nw, float eps, int M, int H, int KO, int I,
              unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // bulk copies, mbarrier tx counts
  static_assert(C % (64 * WARPS) == 0 && S >= 2, "whole 64-byte row pieces per warp");
  constexpr int RS = C + 64;
  constexpr int RES = 4, NORM_GLU = 9;  // gemv_mma.cuh's PROs: residual; RMSNorm + SwiGLU
  extern __shared__ uint4 smem[];
  __shared__ __align__(8) unsigned long long full[S], empty[S];
  __shared__ float red[2 * WARPS * 4 * 32];
  __shared__ float part[(WARPS + 1) * 8];
#ifndef GEMV_LATE_TRIGGER
  pdl_trigger();
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  BulkRing<WARPS, S, C, RS> ring;
  ring.init(smem, full, empty);
  auto plain = [&](int N) {
    return [N](int tile, int r) {
      int ra, rb;
      tile_rows<false>(tile, r & 7, N, ra, rb);
      return r & 8 ? rb : ra;
    };
  };
  if (warp == WARPS) {  // the producer: the three weights' items one after another
    if (lane == 0) {
      int i = 0;
      ring.start(wo, H, 2 * KO);
      ring.produce(i, plain(H));
      ring.start(wgu, 2 * I, 2 * H);
      ring.produce(i, [&](int tile, int r) {
        int ra, rb;
        tile_rows<true>(tile, r & 7, 2 * I, ra, rb);
        return r & 8 ? rb : ra;
      });
      ring.start(wd, H, 2 * I);
      ring.produce(i, plain(H));
    }
    return;  // (an exit counts as the block's PDL trigger)
  }
  const char* slots = reinterpret_cast<const char*>(smem);
  uint4* xs = smem + S * ring.SLOT / 16;
  int per0, n0, per1, n1, per2, n2;  // each matmul's items per tile and in this block
  ring.items(H, 2 * KO, per0, n0);
  ring.items(2 * I, 2 * H, per1, n1);
  ring.items(H, 2 * I, per2, n2);
  pdl_wait();  // PDL: o, h_in and h only after the previous kernel is done (see pdl.cuh)
  stage_x<0, WARPS, false, true>(xs, o, nw, eps, M, KO >> 3, part);
  bulk_bf16_items<WARPS, S, C, RES>(ring, 0, n0, per0, -1, slots, xs, KO >> 3, h, h_in, red,
                                    M, H);
  consumers_grid_sync<WARPS>(bar, warp, lane);
  stage_x<1, WARPS, false, true>(xs, reinterpret_cast<const uint4*>(h), nw, eps, M, H >> 3,
                                 part);
  bulk_bf16_items<WARPS, S, C, NORM_GLU>(ring, n0, n1, per1, -1, slots, xs, H >> 3, act,
                                         nullptr, red, M, 2 * I);
  consumers_grid_sync<WARPS>(bar, warp, lane);
  stage_x<0, WARPS, false, true>(xs, reinterpret_cast<const uint4*>(act), nw, eps, M, I >> 3,
                                 part);
  bulk_bf16_items<WARPS, S, C, RES>(ring, n0 + n1, n2, per2, max(n2 - S, 0), slots, xs,
                                    I >> 3, h, h, red, M, H);
#else
  __trap();  // Gemv routes nothing here below sm_90 (Gemv.bulk_capable)
#endif
}
