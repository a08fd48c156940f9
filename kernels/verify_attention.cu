// Verify attention on the tensor cores: R = M * G query rows of one kv head (G = Hq / Hkv,
// M = k + 1 tokens per sequence) over the KV cache, for R past the warp-per-key kernel's 8
// rows (decode_attention.cu). Same inputs, workspace and output contract as attn_partial
// (attention_partial.cu): bf16, head_dim D in {64, 128}.
//
// Cache of one layer: k_cache, v_cache [slots, max_len, Hkv, D] (element (s, p, h, d) at
// s * stride_slot + p * stride_pos + h * D + d; rows 16-byte aligned). Step: slots [B] int64,
// positions [B, M] int64; key p is visible to query (b, m) iff p <= positions[b, m].
// q [B, M, Hq, D] dense; row r = m * G + g of kv head h is q[b, m, h * G + g].
//
// attn_verify: grid (B * Hkv, row groups, splits), 32 * MT * KW threads. A block takes
//   ROWS = 16 * MT query rows of one kv head (zero-padded past R) and one split of the
//   context (flash-decoding), in tiles of VERIFY_TILE = 64 keys: K and V staged as bf16 in
//   shared memory with cp.async (16-byte copies, zero-filled past the split), two stages.
//   Warp (mt, kw) owns m-tile mt (16 rows) and keys [kw * KPW, +KPW) of every tile (KPW =
//   64 / KW), with its own online softmax (running max and sum per row):
//     S = Q K^T           mma.sync m16n8k16 (bf16 in, fp32 out), Q and K from shared memory;
//     mask, scale (base-2 logits: scale * log2(e)), online softmax in registers;
//     O = O * rescale + P V   P rounded to bf16 straight from S's accumulators (the C
//                             fragment of two n-tiles is the A fragment of one k-step).
//   Then the KW warps of an m-tile merge through shared memory (reusing the K/V stages), and
//   the block writes unnormalised acc [ROWS, D] and (max, sum) (natural log base) per row to
//   the workspace as attn_partial does; the last block of (b, kvh, row group) to finish
//   merges the splits into out [B, M, Hq, D] (common.cuh's last_to_arrive, merge_rows).
//   tickets [>= B*Hkv*row_groups] int32, zero before the launch (and after it).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16; gemv_mma.cuh's mma_bf16), lane = 4 g + t:
//   A (16 x 16, row-major): a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..), a2 (row g,
//   k 2t+8..), a3 (row g+8, k 2t+8..); B (16 x 8): b0 (k 2t..2t+1, col g), b1 (k 2t+8.., col g);
//   C (16 x 8, fp32): c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1).
//   Pairs are packed low element first. Every fragment is read from shared memory with plain
//   32-bit (Q, K) or 16-bit (V) loads at these coordinates: no ldmatrix, no layout assumed
//   beyond the ISA's.
// Shared rows are padded to D + 8 elements (bf16) / D + 8 floats (the O merge), so the 8 x 4
// lanes of a fragment load hit 32 distinct banks.
#include "common.cuh"
#include "gemv_mma.cuh"

#define VERIFY_TILE 64  // keys per tile (all warps of the block)
#define VERIFY_PAD 8    // elements of padding per shared row

template <int D, int MT>
struct VerifyShape {
  static constexpr int TK = VERIFY_TILE;
  static constexpr int KW = MT <= 2 ? 4 : 2;  // warps per m-tile, along the keys of a tile
  static constexpr int WARPS = MT * KW;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int KPW = TK / KW;  // keys per warp per tile: 16 or 32
  static constexpr int NT = KPW / 8;   // n-tiles of S per warp
  static constexpr int KS = KPW / 16;  // k-steps of P V per warp
  static constexpr int ROWS = 16 * MT;
  static constexpr int STRIDE = D + VERIFY_PAD;  // bf16 row stride of Q, K, V in shared memory
  static constexpr int OSTRIDE = D + VERIFY_PAD;  // fp32 row stride of the O merge
  static constexpr int CHUNKS = D / 8;  // 16-byte pieces of a row
  static constexpr int STAGE = 2 * TK * STRIDE;  // bf16 elements of one stage: K then V
  static constexpr int SMEM = (ROWS * STRIDE + 2 * STAGE) * 2;  // dynamic shared bytes
  static_assert(D % 16 == 0 && KPW % 16 == 0, "tile shape");
  static_assert(WARPS * 16 * OSTRIDE * 4 <= 2 * STAGE * 2, "the O merge fits the K/V stages");
};

// 16-byte copy global -> shared that lands later (cp.async, L1 bypassed); bytes = 0 fills the
// 16 shared bytes with zeros and reads nothing.
__device__ __forceinline__ void verify_cp16(void* dst, const void* src, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                   (u32)__cvta_generic_to_shared(dst)),
               "l"(src), "r"(fill ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void verify_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void verify_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ u32 lds32(const u16* p) { return *reinterpret_cast<const u32*>(p); }

// Two bf16 of one column in consecutive rows: (p[0], p[STRIDE]) packed low first.
template <int STRIDE>
__device__ __forceinline__ u32 column_pair(const u16* p) {
  return (u32)p[0] | ((u32)p[STRIDE] << 16);
}

template <int D, int MT>
__device__ void attn_verify_impl(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
                                 const bf16_t* __restrict__ v_cache,
                                 const long long* __restrict__ slots,
                                 const long long* __restrict__ positions, long long stride_slot,
                                 long long stride_pos, float* __restrict__ part_acc,
                                 float* __restrict__ part_ml, bf16_t* __restrict__ out,
                                 int* __restrict__ tickets, int m_tokens, int hq, int hkv,
                                 float scale_log2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using S = VerifyShape<D, MT>;
  extern __shared__ __align__(16) unsigned char verify_smem[];
  __shared__ float s_wmax[S::WARPS][16];  // each warp's running max per row (base 2)
  __shared__ float s_wsum[S::WARPS][16];  // ... and sum
  __shared__ float s_rmax[S::ROWS];       // the block's max per row (base 2)
  __shared__ float s_rsum[S::ROWS];
  u16* s_q = reinterpret_cast<u16*>(verify_smem);  // [ROWS][STRIDE]
  u16* s_kv = s_q + S::ROWS * S::STRIDE;           // [2 stages][K, V][TK][STRIDE]
  float* s_o = reinterpret_cast<float*>(s_kv);     // after the loop: [WARPS][16][OSTRIDE]

  const int g_size = hq / hkv;
  const int rows = m_tokens * g_size;  // R
  const int b = blockIdx.x / hkv, kvh = blockIdx.x % hkv;
  const int row0 = blockIdx.y * S::ROWS;
  const int split = blockIdx.z, splits = gridDim.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int mt = warp / S::KW, kw = warp % S::KW;
  const int g = lane >> 2, t = lane & 3;

  // this split's keys [k_begin, k_end): the context cut in `splits` chunks of whole tiles
  const long long* pos_b = positions + (long long)b * m_tokens;
  const long long ctx = pos_b[m_tokens - 1] + 1;
  long long chunk = (ctx + splits - 1) / splits;
  chunk = (chunk + S::TK - 1) / S::TK * S::TK;
  const int active = (int)((ctx + chunk - 1) / chunk);  // splits holding keys
  if (split >= active) return;
  const long long k_begin = (long long)split * chunk;
  const long long k_end = ctx < k_begin + chunk ? ctx : k_begin + chunk;
  const int n_keys = (int)(k_end - k_begin);
  const int ntiles = (n_keys + S::TK - 1) / S::TK;
  const long long base = slots[b] * stride_slot + (long long)kvh * D;

  // K and V of tile i (keys k_begin + i * TK ..) into stage st; past k_end: zeros
  auto load_tile = [&](int i, int st) {
    u16* sk = s_kv + st * S::STAGE;
    u16* sv = sk + S::TK * S::STRIDE;
#pragma unroll
    for (int e = tid; e < S::TK * S::CHUNKS; e += S::THREADS) {
      const int j = e / S::CHUNKS, c = (e % S::CHUNKS) * 8;
      const int key = i * S::TK + j;  // within the split
      const bool in = key < n_keys;
      const long long off = base + (k_begin + (in ? key : 0)) * stride_pos + c;
      verify_cp16(sk + j * S::STRIDE + c, k_cache + off, in);
      verify_cp16(sv + j * S::STRIDE + c, v_cache + off, in);
    }
  };
  load_tile(0, 0);
  verify_commit();

  // the block's query rows, bf16, zero past R
  for (int e = tid; e < S::ROWS * S::CHUNKS; e += S::THREADS) {
    const int r = e / S::CHUNKS, c = (e % S::CHUNKS) * 8, gr = row0 + r;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (gr < rows) {
      const int mm = gr / g_size, gg = gr % g_size;
      val = *reinterpret_cast<const uint4*>(
          q + (((long long)b * m_tokens + mm) * hq + kvh * g_size + gg) * D + c);
    }
    *reinterpret_cast<uint4*>(s_q + r * S::STRIDE + c) = val;
  }

  // the last visible key of this thread's rows g, g + 8, counted from k_begin (< 0: none)
  int last[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = row0 + mt * 16 + g + 8 * h;
    long long p = gr < rows ? pos_b[gr / g_size] : -1;
    p = p < k_end - 1 ? p : k_end - 1;
    last[h] = (int)(p < k_begin ? -1 : p - k_begin);
  }

  float o[S::CHUNKS][4];  // O: rows g, g+8 x cols 8 n + 2t, +1 (C layout)
#pragma unroll
  for (int n = 0; n < S::CHUNKS; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {-inf_f(), -inf_f()};  // running max of rows g, g + 8 (base 2)
  float l_run[2] = {0.f, 0.f};            // running sum, this thread's columns only

  const u16* sq = s_q + mt * 16 * S::STRIDE;
  for (int i = 0; i < ntiles; ++i) {
    if (i + 1 < ntiles) load_tile(i + 1, (i + 1) & 1);
    verify_commit();  // (an empty group on the last tile: the count stays uniform)
    verify_wait<1>();  // this thread's copies of tile i have landed
    __syncthreads();   // everyone's (and s_q)
    const u16* sk = s_kv + (i & 1) * S::STAGE + kw * S::KPW * S::STRIDE;  // this warp's keys
    const u16* sv = sk + S::TK * S::STRIDE;

    // S = Q K^T: s[n] holds keys 8 n + 2t, +1 of rows g, g + 8 (this warp's KPW keys)
    float s[S::NT][4];
#pragma unroll
    for (int n = 0; n < S::NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      const u16* qa = sq + g * S::STRIDE + kk + 2 * t;
      const u32 a0 = lds32(qa), a1 = lds32(qa + 8 * S::STRIDE);
      const u32 a2 = lds32(qa + 8), a3 = lds32(qa + 8 * S::STRIDE + 8);
#pragma unroll
      for (int n = 0; n < S::NT; ++n) {
        const u16* kb = sk + (8 * n + g) * S::STRIDE + kk + 2 * t;  // key 8n + g, dims 2t..
        mma_bf16(s[n], a0, a1, a2, a3, lds32(kb), lds32(kb + 8));
      }
    }

    // mask, base-2 logits, the rows' new running max over the 4 lanes that share a row
    const int key0 = i * S::TK + kw * S::KPW + 2 * t;  // key of s[0][0], within the split
    float mx[2] = {-inf_f(), -inf_f()};
#pragma unroll
    for (int n = 0; n < S::NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const float v = key0 + 8 * n + (e & 1) <= last[h] ? s[n][e] * scale_log2 : -inf_f();
        s[n][e] = v;
        mx[h] = fmaxf(mx[h], v);
      }
    float sc[2], sub[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_new = fmaxf(m_run[h], mx[h]);
      const bool none = m_new == -inf_f();  // no visible key yet: nothing to rescale
      sc[h] = none ? 1.f : exp2f(m_run[h] - m_new);
      sub[h] = none ? 0.f : m_new;
      m_run[h] = m_new;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < S::NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[n][e] - sub[e >> 1]);  // masked: exp2(-inf) = 0
        s[n][e] = p;
        sum[e >> 1] += p;
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * sc[h] + sum[h];
#pragma unroll
    for (int n = 0; n < S::CHUNKS; ++n) {
      o[n][0] *= sc[0];
      o[n][1] *= sc[0];
      o[n][2] *= sc[1];
      o[n][3] *= sc[1];
    }

    // O += P V: k-step ks takes keys 16 ks .. +16 (S n-tiles 2 ks, 2 ks + 1)
#pragma unroll
    for (int ks = 0; ks < S::KS; ++ks) {
      const u32 a0 = pack_bf16(s[2 * ks][0], s[2 * ks][1]);
      const u32 a1 = pack_bf16(s[2 * ks][2], s[2 * ks][3]);
      const u32 a2 = pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      const u32 a3 = pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3]);
      const u16* vb = sv + (16 * ks + 2 * t) * S::STRIDE + g;  // keys 2t, 2t+1; dim g
#pragma unroll
      for (int n = 0; n < S::CHUNKS; ++n) {
        const u16* vp = vb + 8 * n;
        mma_bf16(o[n], a0, a1, a2, a3, column_pair<S::STRIDE>(vp),
                 column_pair<S::STRIDE>(vp + 8 * S::STRIDE));
      }
    }
    __syncthreads();  // stage i & 1 is read: the next iteration's copies may overwrite it
  }
  verify_wait<0>();

  // merge the KW warps of each m-tile: rows' max and sum, then their O rescaled in s_o
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    if (t == 0) {
      s_wmax[warp][g + 8 * h] = m_run[h];
      s_wsum[warp][g + 8 * h] = l_run[h];
    }
  }
  __syncthreads();
  float f[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    float mmax = -inf_f(), lsum = 0.f;
#pragma unroll
    for (int w = 0; w < S::KW; ++w) mmax = fmaxf(mmax, s_wmax[mt * S::KW + w][r]);
#pragma unroll
    for (int w = 0; w < S::KW; ++w) {
      const float mw = s_wmax[mt * S::KW + w][r];
      lsum += mw == -inf_f() ? 0.f : exp2f(mw - mmax) * s_wsum[mt * S::KW + w][r];
    }
    f[h] = m_run[h] == -inf_f() ? 0.f : exp2f(m_run[h] - mmax);
    if (kw == 0 && t == 0) {
      s_rmax[mt * 16 + r] = mmax;
      s_rsum[mt * 16 + r] = lsum;
    }
  }
  float* so = s_o + warp * 16 * S::OSTRIDE;
#pragma unroll
  for (int n = 0; n < S::CHUNKS; ++n) {
    *reinterpret_cast<float2*>(so + g * S::OSTRIDE + 8 * n + 2 * t) =
        make_float2(o[n][0] * f[0], o[n][1] * f[0]);
    *reinterpret_cast<float2*>(so + (g + 8) * S::OSTRIDE + 8 * n + 2 * t) =
        make_float2(o[n][2] * f[1], o[n][3] * f[1]);
  }
  __syncthreads();

  // this split's partial results (attn_partial's workspace layout)
  const long long row_base = ((long long)b * hkv + kvh) * rows;
  for (int e = tid; e < S::ROWS * (D / 4); e += S::THREADS) {
    const int r = e / (D / 4), c = (e % (D / 4)) * 4, gr = row0 + r;
    if (gr < rows) {
      const int rm = r >> 4, rr = r & 15;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < S::KW; ++w) {
        const float4 x =
            *reinterpret_cast<const float4*>(s_o + ((rm * S::KW + w) * 16 + rr) * S::OSTRIDE + c);
        acc.x += x.x;
        acc.y += x.y;
        acc.z += x.z;
        acc.w += x.w;
      }
      *reinterpret_cast<float4*>(part_acc + ((row_base + gr) * splits + split) * D + c) = acc;
    }
  }
  for (int r = tid; r < S::ROWS; r += S::THREADS) {
    const int gr = row0 + r;
    if (gr < rows) {
      part_ml[((row_base + gr) * splits + split) * 2] = s_rmax[r] * 0.69314718055994531f;
      part_ml[((row_base + gr) * splits + split) * 2 + 1] = s_rsum[r];
    }
  }
  if (last_to_arrive(tickets + blockIdx.x * gridDim.y + blockIdx.y, active))
    merge_rows<bf16_t>(part_acc, part_ml, out, b, kvh, row0,
                       rows - row0 < S::ROWS ? rows - row0 : S::ROWS, m_tokens, hq, hkv, D,
                       splits, active);
#endif
}

// attn_verify_bf16_d{D}_t{MT}: one entry per head_dim and m-tiles per block
#define VERIFY_ENTRY(D, MT)                                                                   \
  extern "C" __global__ void __launch_bounds__(VerifyShape<D, MT>::THREADS, 2)               \
      attn_verify_bf16_d##D##_t##MT(                                                          \
          const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache,                      \
          const long long* slots, const long long* positions, long long stride_slot,         \
          long long stride_pos, float* part_acc, float* part_ml, bf16_t* out, int* tickets,   \
          int m_tokens, int hq, int hkv, float scale_log2) {                                  \
    attn_verify_impl<D, MT>(q, k_cache, v_cache, slots, positions, stride_slot, stride_pos,   \
                            part_acc, part_ml, out, tickets, m_tokens, hq, hkv, scale_log2);  \
  }

VERIFY_ENTRY(64, 1)
VERIFY_ENTRY(64, 2)
VERIFY_ENTRY(64, 3)
VERIFY_ENTRY(64, 4)
VERIFY_ENTRY(128, 1)
VERIFY_ENTRY(128, 2)
VERIFY_ENTRY(128, 3)
VERIFY_ENTRY(128, 4)
