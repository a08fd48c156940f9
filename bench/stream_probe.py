"""How fast this GPU streams a large buffer through three load paths (H200 diagnosis).

    python bench/stream_probe.py [--gib 1] [--reps 10]

The ring gemvs (kernels/gemv_ring.cu) stream their weights with per-thread cp.async into
shared memory; on one H200 node they kept pace with the tuned register-load kernels, on
another they ran at ~63% of copy (bench/results/NOTES_decode.md, session 8). This times a
pure read of a buffer far larger than L2, each 16-byte vector XOR-folded so nothing is
dropped, through:
  ld      ld.global.nc.L2::256B into registers, 4 vectors per thread in flight;
  cpasync per-thread rings of S shared-memory slots filled by cp.async.cg (the ring gemvs' way);
  bulk    per-warp rings of S slots of C bytes, each filled by one cp.async.bulk (the Hopper
          bulk-copy engine) completing on an mbarrier, read by the warp's 32 lanes.
Prints GB/s read and the fraction of the device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import cupy
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from kestrel_rt.cuda.module import current_stream

SOURCE = r"""
typedef unsigned int u32;
__device__ __forceinline__ uint4 ld_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void fold(uint4& a, uint4 v) {
  a.x ^= v.x; a.y ^= v.y; a.z ^= v.z; a.w ^= v.w;
}

// n vectors, 4 per thread in flight; out[thread] = XOR of its vectors.
extern "C" __global__ void ld_stream(const uint4* __restrict__ src, long long n, uint4* out) {
  const long long T = (long long)gridDim.x * blockDim.x;
  const long long me = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long i = me; i < n; i += 4 * T) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = i + u * T < n ? ld_nc(src + i + u * T) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) fold(acc, v[u]);
  }
  out[me] = acc;
}

// A per-thread ring of S slots filled by cp.async: the thread's items i < items are the
// vectors src + at(i), item i in slot i % S of ring [S][blockDim.x]; returns their XOR.
template <int S, class At>
__device__ uint4 cpasync_fold(const uint4* __restrict__ src, long long items, At at) {
  extern __shared__ uint4 ring[];
  auto issue = [&](long long i) {
    if (i < items) {
      const u32 dst = (u32)__cvta_generic_to_shared(ring + (i % S) * blockDim.x + threadIdx.x);
      asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst),
                   "l"(src + at(i)) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  for (int s = 0; s < S - 1; ++s) issue(s);
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long i = 0; i < items; ++i) {
    issue(i + S - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory");
    fold(acc, ring[(i % S) * blockDim.x + threadIdx.x]);
  }
  return acc;
}

// Per-thread rings: item i of a thread is vector me + i T.
template <int S>
__device__ void cpasync_body(const uint4* __restrict__ src, long long n, uint4* out) {
  const long long T = (long long)gridDim.x * blockDim.x;
  const long long me = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const long long items = me < n ? (n - 1 - me) / T + 1 : 0;
  out[me] = cpasync_fold<S>(src, items, [&](long long i) { return me + i * T; });
}
extern "C" __global__ void cpasync_4(const uint4* s, long long n, uint4* o) { cpasync_body<4>(s, n, o); }
extern "C" __global__ void cpasync_8(const uint4* s, long long n, uint4* o) { cpasync_body<8>(s, n, o); }

// Per-warp rings of S slots of C bytes: chunk i of warp gw is chunk gw + i W of the buffer;
// lane 0 issues one bulk copy per slot, all lanes wait on the slot's mbarrier and fold it.
template <int S, int C>
__device__ void bulk_body(const uint4* __restrict__ src, long long n, uint4* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int V = C / 16;  // vectors per chunk
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem) + warp * S;
  uint4* ring = reinterpret_cast<uint4*>(smem + 8 * S * warps) + (size_t)warp * S * V;
  const long long W = (long long)gridDim.x * warps, gw = blockIdx.x * (long long)warps + warp;
  const long long chunks = n / V;
  const long long items = gw < chunks ? (chunks - 1 - gw) / W + 1 : 0;
  if (lane == 0)
    for (int s = 0; s < S; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"((u32)__cvta_generic_to_shared(bar + s)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  auto issue = [&](long long i) {
    if (lane == 0 && i < items) {
      const int s = (int)(i % S);
      const u32 b = (u32)__cvta_generic_to_shared(bar + s);
      const u32 d = (u32)__cvta_generic_to_shared(ring + s * V);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(C) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(d), "l"(src + (gw + i * W) * V), "r"(C), "r"(b) : "memory");
    }
  };
  for (int s = 0; s < S; ++s) issue(s);
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long i = 0; i < items; ++i) {
    const int s = (int)(i % S);
    const u32 b = (u32)__cvta_generic_to_shared(bar + s), parity = (u32)((i / S) & 1);
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 " @!p bra W; }" ::"r"(b), "r"(parity) : "memory");
#pragma unroll 8
    for (int v = lane; v < V; v += 32) fold(acc, ring[s * V + v]);
    __syncwarp();
    issue(i + S);
  }
  out[blockIdx.x * (long long)blockDim.x + threadIdx.x] = acc;
}
extern "C" __global__ void bulk_4_4096(const uint4* s, long long n, uint4* o) { bulk_body<4, 4096>(s, n, o); }
extern "C" __global__ void bulk_4_8192(const uint4* s, long long n, uint4* o) { bulk_body<4, 8192>(s, n, o); }
extern "C" __global__ void bulk_8_4096(const uint4* s, long long n, uint4* o) { bulk_body<8, 4096>(s, n, o); }
extern "C" __global__ void bulk_4_16384(const uint4* s, long long n, uint4* o) { bulk_body<4, 16384>(s, n, o); }
// Weight-tile patterns of the ring gemvs: W [N, 4096] bf16 (512 vectors per row) in tiles of
// 16 rows (128 KB), blocks of 512 threads (16 warps) walking tiles blockIdx.x, + gridDim.x, ...
// A thread's 16 vectors of a tile, e = 0..15: MAP 0 the ring gemv's (warp ks, lane (g, t)):
// row g + 8 (e & 1), vector (ks + 16 (e / 2)) 4 + t: a warp instruction touches 8 rows, 64
// bytes each; MAP 1: vector e 512 + tid of the tile: a warp instruction reads 512 contiguous
// bytes of one row.
template <int MAP>
__device__ __forceinline__ long long tile_vec(long long tile, int e) {
  const int tid = threadIdx.x;
  if (MAP == 0) {
    const int ks = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
    return (16 * tile + g + 8 * (e & 1)) * 512 + (ks + 16 * (e >> 1)) * 4 + t;
  }
  return tile * 8192 + e * 512 + tid;
}

// Per-thread rings of S slots (cp.async), the items of all the block's tiles in turn.
template <int MAP, int S>
__device__ void tile_cpasync(const uint4* __restrict__ src, long long n, uint4* out) {
  const long long tiles = n / 8192;
  const long long mine = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  out[blockIdx.x * 512ll + threadIdx.x] = cpasync_fold<S>(src, 16 * mine, [&](long long i) {
    return tile_vec<MAP>(blockIdx.x + (i >> 4) * gridDim.x, (int)(i & 15));
  });
}

// Register loads, U vectors in flight per thread.
template <int MAP, int U>
__device__ void tile_ld(const uint4* __restrict__ src, long long n, uint4* out) {
  const long long tiles = n / 8192;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
#pragma unroll
    for (int e0 = 0; e0 < 16; e0 += U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = ld_nc(src + tile_vec<MAP>(tile, e0 + u));
#pragma unroll
      for (int u = 0; u < U; ++u) fold(acc, v[u]);
    }
  }
  out[blockIdx.x * 512ll + threadIdx.x] = acc;
}
extern "C" __global__ void __launch_bounds__(512) ring_cp_0(const uint4* s, long long n, uint4* o) { tile_cpasync<0, 16>(s, n, o); }
extern "C" __global__ void __launch_bounds__(512) ring_cp_1(const uint4* s, long long n, uint4* o) { tile_cpasync<1, 16>(s, n, o); }
extern "C" __global__ void __launch_bounds__(512) ring_ld_0(const uint4* s, long long n, uint4* o) { tile_ld<0, 8>(s, n, o); }
extern "C" __global__ void __launch_bounds__(512) ring_ld_1(const uint4* s, long long n, uint4* o) { tile_ld<1, 8>(s, n, o); }
"""

# (kernel, blocks per SM (0: one per tile), threads per block, dynamic shared bytes per block)
CASES = [
    ("ld_stream", 4, 256, lambda t: 0),
    ("ld_stream", 8, 256, lambda t: 0),
    ("cpasync_4", 2, 256, lambda t: 4 * 16 * t),
    ("cpasync_8", 2, 256, lambda t: 8 * 16 * t),
    ("cpasync_8", 1, 512, lambda t: 8 * 16 * t),
    ("bulk_4_4096", 2, 128, lambda t: (t // 32) * 4 * (4096 + 8)),
    ("bulk_8_4096", 1, 128, lambda t: (t // 32) * 8 * (4096 + 8)),
    ("bulk_4_8192", 1, 128, lambda t: (t // 32) * 4 * (8192 + 8)),
    ("bulk_4_16384", 1, 64, lambda t: (t // 32) * 4 * (16384 + 8)),
    ("bulk_4_16384", 2, 32, lambda t: (t // 32) * 4 * (16384 + 8)),
    # the ring gemv's tile walk: one block per SM (persistent), or one per tile ("tiles")
    ("ring_cp_0", 1, 512, lambda t: 16 * 16 * t),
    ("ring_cp_1", 1, 512, lambda t: 16 * 16 * t),
    ("ring_ld_0", 1, 512, lambda t: 0),
    ("ring_ld_1", 1, 512, lambda t: 0),
    ("ring_ld_0", 0, 512, lambda t: 0),
    ("ring_cp_0", 0, 512, lambda t: 16 * 16 * t),
]


def launch(stream, fn, grid: int, threads: int, args: tuple, shared: int) -> None:
    with stream:
        fn((grid,), (threads,), args, shared_mem=shared)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size read per run")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n = int(args.gib * (1 << 30)) // 16 // 65536 * 65536  # vectors, whole chunks of every size
    buf = torch.randint(-(2**31), 2**31 - 1, (n * 4,), dtype=torch.int32, device=dev)
    copy = measure.copy_bandwidth()
    mod = cupy.RawModule(code=SOURCE, options=("-std=c++17", "-arch=sm_90"))
    stream = current_stream(cupy, dev.index or 0, {})
    ref = np.bitwise_xor.reduce(buf.view(-1, 4).cpu().numpy().view(np.uint32), axis=0)
    print(
        f"{torch.cuda.get_device_name(dev)}: copy {copy / 1e9:.0f} GB/s, buffer "
        f"{n * 16 / 2**30:.2f} GiB"
    )
    print(
        f"{'path':<14} {'blocks/SM':>9} {'threads':>7} {'smem KB':>7} {'us':>9} "
        f"{'GB/s':>7} {'of copy':>8}  xor"
    )
    for name, bps, threads, smem in CASES:
        fn = mod.get_function(name)
        shared = smem(threads)
        if shared > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = shared
        grid = sms * bps if bps else n // 8192  # 0: one block per 16-row tile
        out = torch.zeros(grid * threads * 4, dtype=torch.int32, device=dev)

        args_ = (np.uint64(buf.data_ptr()), np.int64(n), np.uint64(out.data_ptr()))
        run = functools.partial(launch, stream, fn, grid, threads, args_, shared)
        run()
        folds = np.bitwise_xor.reduce(out.view(-1, 4).cpu().numpy().view(np.uint32), axis=0)
        ok = "ok" if (folds == ref).all() else "WRONG"
        s = measure.median_event_s(run, args.reps)
        gbps = n * 16 / s / 1e9
        print(
            f"{name:<14} {bps:>9} {threads:>7} {shared / 1024:>7.1f} {s * 1e6:>9.1f} "
            f"{gbps:>7.0f} {gbps * 1e9 / copy:>8.1%}  {ok}",
            flush=True,
        )


if __name__ == "__main__":
    main()
