// int8 weight-only skinny matmul: y[M, N] = x[M, K] @ (q[N, K] * scale[N])^T, M <= 16.
// q int8 row-major (symmetric, per output channel), scale fp32 [N], x / y bf16; K % 16 == 0.
//
// Dequantization in registers, exact: each int8 q is split into nibbles, q = 16 h + l with
// h signed in [-8, 7] and l in [0, 15]; both are small integers, exact in bf16, built with
// one lop3 per pair (OR / XOR into the bf16 pattern of 128) and one bf16x2 add of -128 /
// -136. Two accumulators, C_h and C_l, both on the tensor cores: q.x = 16 C_h + C_l, and the
// row's scale is applied once at the end. A word of 4 bytes (k0..k3) gives the pairs
// (k0, k2) and (k1, k3), so the activation pairs are permuted the same way (prmt).
// Software pipelined like gemv.cu: the next iteration's loads go out before this one's math.
// PRO (SwiGLU of x as it loads for the expert kernels; the residual and SwiGLU epilogues):
// gemv_mma.cuh.
#include "gemv_mma.cuh"

// x: [M, K] (PRO 2: [M, 2K]); res: residual [M, N] or nullptr; red: the K-split shared
// floats.
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__device__ __forceinline__ void gemv_int8_body(const uint4* __restrict__ q,
                                               const float* __restrict__ scale,
                                               const uint4* __restrict__ x, u16* y,
                                               const u16* res, int M, int N, int K,
                                               float* red) {
  static_assert(!GEMV_RSTD(PRO), "the row-scale RMSNorm is in the bf16 kernels only");
  const TileThread<KSPLIT, TPB, GEMV_GLU(PRO)> th(N);
  const int g = th.g, t = th.t, ks = th.ks;
  const int qv = K >> 4;  // 16-byte vectors (16 k) per weight row
  const uint4* qa = q + (size_t)th.ra * qv;
  const uint4* qb = q + (size_t)th.rb * qv;
  float acc[2][2][MT][4] = {};  // [C_l, C_h][word parity: two mma chains each]
  const int nsub = (qv + 3) >> 2, stride = KSPLIT * U;
  uint4 A[U], B[U], X[U][MT][2];
  pdl_wait();  // PDL: nothing is read before the previous kernel is done (see pdl.cuh)
  XLoad<GEMV_ACT(PRO), MT> xl;
  xl.init(x, g, M, K);
  load_stage<MT, U, 2, PF>(A, B, X, qa, qb, xl, ks * U, t, qv);
  for (int s0 = ks * U; s0 < nsub; s0 += stride) {
    uint4 An[U], Bn[U], Xn[U][MT][2];
    load_stage<MT, U, 2, PF>(An, Bn, Xn, qa, qb, xl, s0 + stride, t, qv);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u32 wa[4] = {A[u].x, A[u].y, A[u].z, A[u].w};
      const u32 wb[4] = {B[u].x, B[u].y, B[u].z, B[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u32 la[2], lb[2], ha[2], hb[2];
        la[0] = bf16x2_add(and_or(wa[i], 0x000F000Fu, 0x43004300u), 0xC300C300u);
        la[1] = bf16x2_add(and_or(wa[i] >> 8, 0x000F000Fu, 0x43004300u), 0xC300C300u);
        ha[0] = bf16x2_add(and_xor(wa[i] >> 4, 0x000F000Fu, 0x43084308u), 0xC308C308u);
        ha[1] = bf16x2_add(and_xor(wa[i] >> 12, 0x000F000Fu, 0x43084308u), 0xC308C308u);
        lb[0] = bf16x2_add(and_or(wb[i], 0x000F000Fu, 0x43004300u), 0xC300C300u);
        lb[1] = bf16x2_add(and_or(wb[i] >> 8, 0x000F000Fu, 0x43004300u), 0xC300C300u);
        hb[0] = bf16x2_add(and_xor(wb[i] >> 4, 0x000F000Fu, 0x43084308u), 0xC308C308u);
        hb[1] = bf16x2_add(and_xor(wb[i] >> 12, 0x000F000Fu, 0x43084308u), 0xC308C308u);
#pragma unroll
        for (int j = 0; j < MT; ++j) {
          // activations k0..k3 of word i: vector i / 2, registers (i % 2) * 2 and + 1
          const uint4 xv = X[u][j][i >> 1];
          const u32 p = (i & 1) ? xv.z : xv.x, r = (i & 1) ? xv.w : xv.y;
          const u32 x02 = __byte_perm(p, r, 0x5410), x13 = __byte_perm(p, r, 0x7632);
          mma_bf16(acc[0][i & 1][j], la[0], lb[0], la[1], lb[1], x02, x13);
          mma_bf16(acc[1][i & 1][j], ha[0], hb[0], ha[1], hb[1], x02, x13);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      A[u] = An[u];
      B[u] = Bn[u];
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        X[u][j][0] = Xn[u][j][0];
        X[u][j][1] = Xn[u][j][1];
      }
    }
  }
  float tot[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c)
      tot[j][c] = 16.f * (acc[1][0][j][c] + acc[1][1][j][c]) + acc[0][0][j][c] + acc[0][1][j][c];
  GEMV_TRIGGER_END();
  reduce_ksplit<KSPLIT, MT * 4>(&tot[0][0], red, th.tib, ks, th.lane);
  if (ks == 0)
    store_out<MT, PRO>(y, res, tot, th.tile, g, t, M, N, __ldg(scale + th.ra),
                       __ldg(scale + th.rb));
}

// y [M, N] = res + act(x) @ (q * scale)^T (res: nullptr when unused; y may alias res),
// through the epilogue PRO asks for.
template <int MT, int KSPLIT, int TPB, int U, bool PF, int PRO>
__global__ void __launch_bounds__(32 * KSPLIT * TPB)
gemv_int8(const uint4* __restrict__ q, const float* __restrict__ scale,
          const uint4* __restrict__ x, u16* y, int M, int N, int K, const u16* res) {
  __shared__ float red[KSPLIT > 1 ? TPB * KSPLIT * MT * 4 * 32 : 1];
  GEMV_TRIGGER_TOP();
  gemv_int8_body<MT, KSPLIT, TPB, U, PF, PRO>(q, scale, x, y, res, M, N, K, red);
}

// Expert-indexed (MoE): for each pair p = blockIdx.y, y[p] = act(x[p / x_div]) . W[ids[p]]^T,
// one activation row (M = 1; PRO 0 or 2: x rows [K] or gate|up [2K]). W holds E experts back
// to back; ids [P] int64 on the device, so a routed MoE layer runs without a host sync (and
// inside a CUDA graph).
template <int KSPLIT, int TPB, int U, bool PF, int PRO>
__global__ void __launch_bounds__(32 * KSPLIT * TPB)
gemv_int8_experts(const uint4* __restrict__ q, const float* __restrict__ scale,
                  const uint4* __restrict__ x, u16* __restrict__ y,
                  const long long* __restrict__ ids, int x_div, int N, int K) {
  static_assert(PRO == 0 || PRO == 2, "expert kernels take PRO 0 or 2");
  __shared__ float red[KSPLIT > 1 ? TPB * KSPLIT * 4 * 32 : 1];
  pdl_trigger();
  pdl_wait();  // ids come from the routing kernel
  const int p = blockIdx.y;
  const size_t e = (size_t)__ldg(ids + p);
  const size_t xs = (PRO == 2 ? 2 : 1) * (size_t)(K >> 3);  // chunks per x row
  gemv_int8_body<1, KSPLIT, TPB, U, PF, PRO>(q + e * N * (K >> 4), scale + e * N,
                                             x + (p / x_div) * xs, y + (size_t)p * N, nullptr,
                                             1, N, K, red);
}

// Dequantize to bf16 for prefill (then cuBLAS): W[n, k] = q * scale[n], rounded once from fp32
// like the torch reference. One thread per 8 int8 values (8 bytes) -> one 16-byte store.
extern "C" __global__ void dequant_int8(const uint2* __restrict__ q,
                                        const float* __restrict__ scale,
                                        uint4* __restrict__ out, int N, int K) {
  const long long chunks = (long long)N * (K >> 3);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < chunks;
       i += (long long)gridDim.x * blockDim.x) {
    const int n = (int)(i / (K >> 3));
    const float s = __ldg(scale + n);
    const uint2 w = __ldg(q + i);
    u16 v[8];
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const int byte = (int)(signed char)(((b < 4 ? w.x : w.y) >> (8 * (b & 3))) & 0xFFu);
      v[b] = f32_to_bf16((float)byte * s);
    }
    out[i] = make_uint4(v[0] | ((u32)v[1] << 16), v[2] | ((u32)v[3] << 16),
                        v[4] | ((u32)v[5] << 16), v[6] | ((u32)v[7] << 16));
  }
}
