// Decode / verify attention over the KV cache: M = 1..16 new query tokens per sequence,
// grouped-query heads, per-sequence lengths, causal within the new tokens, split over the
// context (flash-decoding: partial softmax per split, then a combine kernel).
//
// Cache of one layer: k_cache, v_cache [slots, max_len, Hkv, D] (element (s, p, h, d) at
// s * stride_slot + p * stride_pos + h * D + d). Step: slots [B] int64, positions [B, M] int64
// (position and cache index of each new token). Key p is visible to query (b, m) iff
// p <= positions[b, m].
//
// kv_write:     k, v [B*M, Hkv*D] (token strides k_st, v_st) -> cache at (slots[b], positions).
// attn_partial: grid (B*Hkv, row_groups, splits), 256 threads. A block takes the R = M*G query
//               rows (m, g) of one kv head (G = Hq / Hkv), RB of them (RB * D <= 4096), and
//               one split of the context, in tiles of TILE keys staged in shared memory;
//               tpd (a power of two <= 32) threads share each query-key dot product.
//               Writes unnormalised acc [.., D] and (max, sum) per (b, kvh, row, split).
// attn_decode:  the same partials for R <= 8 rows and D in {64, 128, 256}: one warp per key,
//               q and the accumulators in registers (faster at decode; see below).
// attn_combine: grid (B*Hkv*R), merges the splits (<= 64) -> out [B, M, Hq, D] in T.
#include "common.cuh"

#define ATTN_THREADS 256
#define ATTN_ACC 16  // ATTN_THREADS * ATTN_ACC = 4096 >= RB * D

template <typename T>
__device__ void kv_write_impl(const T* __restrict__ k, long long k_st, const T* __restrict__ v,
                              long long v_st, T* __restrict__ k_cache, T* __restrict__ v_cache,
                              const long long* __restrict__ slots,
                              const long long* __restrict__ positions, int m, long long stride_slot,
                              long long stride_pos, int width, int vec) {
  constexpr int V = Vec<T>::N;
  const long long t = blockIdx.x;
  const long long b = t / m;
  const long long dst = slots[b] * stride_slot + positions[t] * stride_pos;
  const T* ks = k + t * k_st;
  const T* vs = v + t * v_st;
  if (vec) {
    for (int i = threadIdx.x * V; i < width; i += blockDim.x * V) {
      *reinterpret_cast<uint4*>(k_cache + dst + i) = *reinterpret_cast<const uint4*>(ks + i);
      *reinterpret_cast<uint4*>(v_cache + dst + i) = *reinterpret_cast<const uint4*>(vs + i);
    }
  } else {
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
      k_cache[dst + i] = ks[i];
      v_cache[dst + i] = vs[i];
    }
  }
}

template <typename T>
__device__ void attn_partial_impl(const T* __restrict__ q, const T* __restrict__ k_cache,
                                  const T* __restrict__ v_cache,
                                  const long long* __restrict__ slots,
                                  const long long* __restrict__ positions,
                                  long long stride_slot, long long stride_pos,
                                  float* __restrict__ part_acc, float* __restrict__ part_ml,
                                  int m_tokens, int hq, int hkv, int d, int rb, int tile,
                                  int tpd, float scale) {
  extern __shared__ float smem[];
  constexpr int V = Vec<T>::N;
  const int g_size = hq / hkv;
  const int rows = m_tokens * g_size;  // R
  const int b = blockIdx.x / hkv, kvh = blockIdx.x % hkv;
  const int row0 = blockIdx.y * rb;
  const int split = blockIdx.z, splits = gridDim.z;
  const int tid = threadIdx.x;

  float* s_q = smem;                       // [rb, d], pre-scaled
  const int kstride = d + tpd;             // padded K rows: dot groups hit distinct banks
  float* s_k = s_q + rb * d;               // [tile, kstride]
  float* s_v = s_k + tile * kstride;       // [tile, d]
  float* s_p = s_v + tile * d;             // [rb, tile]
  float* s_m = s_p + rb * tile;            // [rb] running max
  float* s_l = s_m + rb;                   // [rb] running sum
  float* s_scale = s_l + rb;               // [rb] rescale of this tile

  const long long* pos_b = positions + (long long)b * m_tokens;
  const long long ctx = pos_b[m_tokens - 1] + 1;
  long long chunk = (ctx + splits - 1) / splits;
  chunk = (chunk + tile - 1) / tile * tile;
  const long long k_begin = (long long)split * chunk;
  const long long k_end = ctx < k_begin + chunk ? ctx : k_begin + chunk;
  const long long base = slots[b] * stride_slot + (long long)kvh * d;

  for (int e = tid; e < rb * d; e += ATTN_THREADS) {
    const int r = e / d, c = e % d, gr = row0 + r;
    float val = 0.f;
    if (gr < rows) {
      const int mm = gr / g_size, g = gr % g_size;
      val = Num<T>::load(q[(((long long)b * m_tokens + mm) * hq + kvh * g_size + g) * d + c]) * scale;
    }
    s_q[e] = val;
  }
  for (int r = tid; r < rb; r += ATTN_THREADS) {
    s_m[r] = -inf_f();
    s_l[r] = 0.f;
  }
  float acc[ATTN_ACC];
#pragma unroll
  for (int i = 0; i < ATTN_ACC; ++i) acc[i] = 0.f;
  __syncthreads();

  for (long long t0 = k_begin; t0 < k_end; t0 += tile) {
    // stage K and V of keys t0 .. t0 + tile as fp32
    const int vecs = d / V;
    for (int e = tid; e < tile * vecs; e += ATTN_THREADS) {
      const int j = e / vecs, c = (e % vecs) * V;
      float kv[V], vv[V];
      if (t0 + j < k_end) {
        const long long off = base + (t0 + j) * stride_pos + c;
        load_vec(k_cache + off, kv);
        load_vec(v_cache + off, vv);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) kv[i] = vv[i] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < V; ++i) {
        s_k[j * kstride + c + i] = kv[i];
        s_v[j * d + c + i] = vv[i];
      }
    }
    __syncthreads();
    // scores: tpd consecutive threads share one (row, key) dot product over d
    {
      const int per_block = ATTN_THREADS / tpd, gid = tid / tpd, gl = tid % tpd;
      const int pairs = rb * tile;
      const int iters = (pairs + per_block - 1) / per_block;  // uniform: shuffles below
      for (int it = 0; it < iters; ++it) {
        const int e = it * per_block + gid;
        const int r = e / tile, j = e % tile, gr = row0 + r;
        const long long key = t0 + j;
        const bool ok = e < pairs && gr < rows && key < k_end && key <= pos_b[gr / g_size];
        float s = 0.f;
        if (ok) {
          const float* qr = s_q + r * d;
          const float* kr = s_k + j * kstride;
          for (int c = gl; c < d; c += tpd) s = fmaf(qr[c], kr[c], s);
        }
        for (int o = tpd >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (gl == 0 && e < pairs) s_p[e] = ok ? s : -inf_f();
      }
    }
    __syncthreads();
    // online softmax, one warp per row (tile <= 32 keys, one per lane)
    for (int r = tid >> 5; r < rb; r += ATTN_THREADS / 32) {
      const int lane = tid & 31;
      const float s = lane < tile ? s_p[r * tile + lane] : -inf_f();
      const float m_old = s_m[r];
      const float m_new = fmaxf(m_old, warp_max(s));
      float p = 0.f, sc = 1.f;
      if (m_new != -inf_f()) {
        sc = expf(m_old - m_new);
        p = lane < tile ? expf(s - m_new) : 0.f;
      }
      const float sum = warp_sum(p);
      if (lane < tile) s_p[r * tile + lane] = p;
      if (lane == 0) {
        s_m[r] = m_new;
        s_l[r] = s_l[r] * sc + sum;
        s_scale[r] = sc;
      }
    }
    __syncthreads();
    // acc = acc * scale + P V
#pragma unroll
    for (int i = 0; i < ATTN_ACC; ++i) {
      const int e = tid + ATTN_THREADS * i;
      if (e < rb * d) {
        const int r = e / d, c = e % d;
        const float* pr = s_p + r * tile;
        float a = acc[i] * s_scale[r];
        for (int j = 0; j < tile; ++j) a = fmaf(pr[j], s_v[j * d + c], a);
        acc[i] = a;
      }
    }
    __syncthreads();
  }
  // write this split's partial results
  const long long row_base = ((long long)b * hkv + kvh) * rows;
#pragma unroll
  for (int i = 0; i < ATTN_ACC; ++i) {
    const int e = tid + ATTN_THREADS * i;
    if (e < rb * d) {
      const int r = e / d, c = e % d, gr = row0 + r;
      if (gr < rows) part_acc[((row_base + gr) * splits + split) * d + c] = acc[i];
    }
  }
  for (int r = tid; r < rb; r += ATTN_THREADS) {
    const int gr = row0 + r;
    if (gr < rows) {
      part_ml[((row_base + gr) * splits + split) * 2] = s_m[r];
      part_ml[((row_base + gr) * splits + split) * 2 + 1] = s_l[r];
    }
  }
}

template <typename T>
__device__ void attn_combine_impl(const float* __restrict__ part_acc,
                                  const float* __restrict__ part_ml, T* __restrict__ out,
                                  int m_tokens, int hq, int hkv, int d, int splits) {
  __shared__ float s_w[64];  // splits <= 64: weight of each split
  __shared__ float red[32];
  const int g_size = hq / hkv;
  const int rows = m_tokens * g_size;
  const long long row = blockIdx.x;  // (b * hkv + kvh) * rows + gr
  const int gr = (int)(row % rows);
  const long long bk = row / rows;
  const int kvh = (int)(bk % hkv);
  const long long b = bk / hkv;
  const int mm = gr / g_size, g = gr % g_size;
  const float* ml = part_ml + row * splits * 2;
  const int tid = threadIdx.x;
  // block max of the split maxima (blockDim.x >= splits), then weights exp(m_s - max)
  float m = tid < splits ? ml[2 * tid] : -inf_f();
  float mx = m;
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w) mx = fmaxf(mx, red[w]);
  const float wgt = (tid < splits && m != -inf_f()) ? expf(m - mx) : 0.f;
  if (tid < splits) s_w[tid] = wgt;
  const float den = block_sum(tid < splits ? wgt * ml[2 * tid + 1] : 0.f, red);
  T* o = out + ((b * m_tokens + mm) * hq + kvh * g_size + g) * d;
  const float* acc = part_acc + row * splits * d;
  for (int c = tid; c < d; c += blockDim.x) {
    float n0 = 0.f, n1 = 0.f, n2 = 0.f, n3 = 0.f;  // four splits' loads in flight
    int s = 0;
    for (; s + 4 <= splits; s += 4) {
      const float a0 = acc[(long long)s * d + c], a1 = acc[(long long)(s + 1) * d + c];
      const float a2 = acc[(long long)(s + 2) * d + c], a3 = acc[(long long)(s + 3) * d + c];
      n0 = fmaf(a0, s_w[s], n0);
      n1 = fmaf(a1, s_w[s + 1], n1);
      n2 = fmaf(a2, s_w[s + 2], n2);
      n3 = fmaf(a3, s_w[s + 3], n3);
    }
    for (; s < splits; ++s) n0 = fmaf(acc[(long long)s * d + c], s_w[s], n0);
    o[c] = Num<T>::store(((n0 + n1) + (n2 + n3)) / den);
  }
}

// Decode attention for few query rows (R = M * G <= RB): one warp per key, no block barrier
// in the key loop. Lane l holds elements [l * DL, l * DL + DL) of q rows, K, V and the
// accumulators (D = 32 * DL). Grid (B * Hkv, splits), 4 warps; writes the same partials as
// attn_partial (combined by attn_combine).
template <typename T, int DL>
__device__ __forceinline__ void load_lane(const T* p, float* out) {
  constexpr int BYTES = DL * (int)sizeof(T);
  if constexpr (BYTES == 16) {
    load_vec(p, out);
  } else if constexpr (BYTES == 32) {
    load_vec(p, out);
    load_vec(p + Vec<T>::N, out + Vec<T>::N);
  } else if constexpr (BYTES == 8) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < DL; ++i) out[i] = Num<T>::load(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < DL; ++i) out[i] = Num<T>::load(p[i]);
  }
}

#define DECODE_WARPS 4

// Copy DL elements of T (one lane's share of a row), no conversion.
template <typename T, int DL>
__device__ __forceinline__ void copy_lane(T* dst, const T* src) {
  constexpr int BYTES = DL * (int)sizeof(T);
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else if constexpr (BYTES == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  } else {
#pragma unroll
    for (int i = 0; i < DL; ++i) dst[i] = src[i];
  }
}

// k_new / v_new (optional): the step's new K/V [B*M, Hkv*D] (token strides k_st, v_st). When
// given, keys at positions >= positions[b, 0] are read from them rather than the cache, and
// the blocks of split 0 write them into the cache (no other block reads those entries), so
// no separate kv_write launch is needed. (Merging the splits in the last block to finish was
// tried: one block reading every split's partials took longer than attn_combine's launch.)
template <typename T, int DL, int RB>
__device__ void attn_decode_impl(const T* __restrict__ q, T* __restrict__ k_cache,
                                 T* __restrict__ v_cache, const long long* __restrict__ slots,
                                 const long long* __restrict__ positions,
                                 long long stride_slot, long long stride_pos,
                                 float* __restrict__ part_acc, float* __restrict__ part_ml,
                                 int m_tokens, int hq, int hkv, float scale,
                                 const T* __restrict__ k_new, long long k_st,
                                 const T* __restrict__ v_new, long long v_st) {
  constexpr int D = 32 * DL;
  __shared__ float s_acc[DECODE_WARPS][RB][D];
  __shared__ float s_ml[DECODE_WARPS][RB][2];
  const int g_size = hq / hkv;
  const int rows = m_tokens * g_size;
  const int b = blockIdx.x / hkv, kvh = blockIdx.x % hkv;
  const int split = blockIdx.y, splits = gridDim.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long* pos_b = positions + (long long)b * m_tokens;
  const long long first_new = k_new ? pos_b[0] : (long long)1 << 62;
  const long long ctx = pos_b[m_tokens - 1] + 1;
  const long long chunk = (ctx + splits - 1) / splits;
  const long long k_begin = (long long)split * chunk;
  const long long k_end = ctx < k_begin + chunk ? ctx : k_begin + chunk;
  const long long base = slots[b] * stride_slot + (long long)kvh * D + lane * DL;
  const long long new_off = (long long)b * m_tokens;  // token row of (b, 0) in k_new / v_new
  const int head_off = kvh * D + lane * DL;

  if (k_new && split == 0) {  // the new K/V go into the cache
    for (int mm = warp; mm < m_tokens; mm += DECODE_WARPS) {
      const long long dst = base + pos_b[mm] * stride_pos;
      copy_lane<T, DL>(k_cache + dst, k_new + (new_off + mm) * k_st + head_off);
      copy_lane<T, DL>(v_cache + dst, v_new + (new_off + mm) * v_st + head_off);
    }
  }

  float qr[RB][DL], acc[RB][DL], m[RB], l[RB];
  long long last[RB];  // last visible key of each row
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    m[r] = -inf_f();
    l[r] = 0.f;
    last[r] = -1;
#pragma unroll
    for (int i = 0; i < DL; ++i) qr[r][i] = acc[r][i] = 0.f;
    if (r < rows) {
      const int mm = r / g_size, g = r % g_size;
      load_lane<T, DL>(q + (((long long)b * m_tokens + mm) * hq + kvh * g_size + g) * D + lane * DL,
                       qr[r]);
#pragma unroll
      for (int i = 0; i < DL; ++i) qr[r][i] *= scale;
      last[r] = pos_b[mm];
    }
  }
  for (long long key = k_begin + warp; key < k_end; key += 2 * DECODE_WARPS) {
    float kv[2][DL], vv[2][DL];  // two keys' loads in flight per lane
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const long long kk = key + u * DECODE_WARPS;
      if (kk < k_end) {
        if (kk >= first_new) {
          const long long row = new_off + (kk - first_new);
          load_lane<T, DL>(k_new + row * k_st + head_off, kv[u]);
          load_lane<T, DL>(v_new + row * v_st + head_off, vv[u]);
        } else {
          load_lane<T, DL>(k_cache + base + kk * stride_pos, kv[u]);
          load_lane<T, DL>(v_cache + base + kk * stride_pos, vv[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const long long kk = key + u * DECODE_WARPS;
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        if (kk >= k_end || kk > last[r]) continue;  // masked or r >= rows: warp-uniform
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < DL; ++i) s = fmaf(qr[r][i], kv[u][i], s);
        s = warp_sum(s);
        const float m_new = fmaxf(m[r], s);
        const float sc = expf(m[r] - m_new), p = expf(s - m_new);
        l[r] = l[r] * sc + p;
#pragma unroll
        for (int i = 0; i < DL; ++i) acc[r][i] = fmaf(p, vv[u][i], acc[r][i] * sc);
        m[r] = m_new;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RB; ++r) {
#pragma unroll
    for (int i = 0; i < DL; ++i) s_acc[warp][r][lane * DL + i] = acc[r][i];
    if (lane == 0) {
      s_ml[warp][r][0] = m[r];
      s_ml[warp][r][1] = l[r];
    }
  }
  __syncthreads();
  const long long row_base = ((long long)b * hkv + kvh) * rows;
  for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const int r = e / D, c = e % D;
    float mx = -inf_f();
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) mx = fmaxf(mx, s_ml[w][r][0]);
    float a = 0.f, den = 0.f;
    if (mx != -inf_f()) {
#pragma unroll
      for (int w = 0; w < DECODE_WARPS; ++w) {
        const float f = s_ml[w][r][0] == -inf_f() ? 0.f : expf(s_ml[w][r][0] - mx);
        a = fmaf(s_acc[w][r][c], f, a);
        den = fmaf(s_ml[w][r][1], f, den);
      }
    }
    const long long slot = (row_base + r) * splits + split;
    part_acc[slot * D + c] = a;
    if (c == 0) {
      part_ml[slot * 2] = mx;
      part_ml[slot * 2 + 1] = den;
    }
  }
}

#define DECODE_ENTRY(SUFFIX, T, DL, RB)                                                        \
  extern "C" __global__ void __launch_bounds__(32 * DECODE_WARPS)                              \
      attn_decode_##SUFFIX##_d##DL##_r##RB(                                                    \
          const T* q, T* k_cache, T* v_cache, const long long* slots,                          \
          const long long* positions, long long stride_slot, long long stride_pos,             \
          float* part_acc, float* part_ml, int m_tokens, int hq, int hkv, float scale,         \
          const T* k_new, long long k_st, const T* v_new, long long v_st) {                    \
    attn_decode_impl<T, DL, RB>(q, k_cache, v_cache, slots, positions, stride_slot,            \
                                stride_pos, part_acc, part_ml, m_tokens, hq, hkv, scale,       \
                                k_new, k_st, v_new, v_st);                                     \
  }

#define DECODE_ENTRIES(SUFFIX, T)                                                              \
  DECODE_ENTRY(SUFFIX, T, 2, 2) DECODE_ENTRY(SUFFIX, T, 2, 4) DECODE_ENTRY(SUFFIX, T, 2, 8)    \
  DECODE_ENTRY(SUFFIX, T, 4, 2) DECODE_ENTRY(SUFFIX, T, 4, 4) DECODE_ENTRY(SUFFIX, T, 4, 8)    \
  DECODE_ENTRY(SUFFIX, T, 8, 2) DECODE_ENTRY(SUFFIX, T, 8, 4) DECODE_ENTRY(SUFFIX, T, 8, 8)

DECODE_ENTRIES(bf16, bf16_t)
DECODE_ENTRIES(f32, float)

#define ATTN_ENTRY(SUFFIX, T)                                                                   \
  extern "C" __global__ void kv_write_##SUFFIX(                                                \
      const T* k, long long k_st, const T* v, long long v_st, T* k_cache, T* v_cache,         \
      const long long* slots, const long long* positions, int m, long long stride_slot,        \
      long long stride_pos, int width, int vec) {                                              \
    kv_write_impl<T>(k, k_st, v, v_st, k_cache, v_cache, slots, positions, m, stride_slot,     \
                     stride_pos, width, vec);                                                  \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_partial_##SUFFIX(            \
      const T* q, const T* k_cache, const T* v_cache, const long long* slots,                  \
      const long long* positions, long long stride_slot, long long stride_pos,                 \
      float* part_acc, float* part_ml, int m_tokens, int hq, int hkv, int d, int rb, int tile, \
      int tpd, float scale) {                                                                  \
    attn_partial_impl<T>(q, k_cache, v_cache, slots, positions, stride_slot, stride_pos,       \
                         part_acc, part_ml, m_tokens, hq, hkv, d, rb, tile, tpd, scale);       \
  }                                                                                            \
  extern "C" __global__ void attn_combine_##SUFFIX(const float* part_acc, const float* part_ml, \
                                                   T* out, int m_tokens, int hq, int hkv,      \
                                                   int d, int splits) {                        \
    attn_combine_impl<T>(part_acc, part_ml, out, m_tokens, hq, hkv, d, splits);                \
  }

ATTN_ENTRY(bf16, bf16_t)
ATTN_ENTRY(f32, float)
