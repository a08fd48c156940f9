// General decode / verify attention over the KV cache (any R = M * Hq / Hkv query rows, any
// head_dim D <= 256 with D % (16 bytes / element) == 0), and the K/V write it needs. The
// warp-per-key kernel for few rows (decode_attention.cu) covers the common decode shapes;
// this one takes the rest (verify with many rows, odd head_dim).
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
//               Writes unnormalised acc [.., D] and (max, sum) per (b, kvh, row, split)
//               to the workspace; the last block of (b, kvh, row group) to finish merges
//               them into out [B, M, Hq, D] (common.cuh's last_to_arrive, merge_rows).
//               tickets [>= B*Hkv*row_groups] int32, zero before the launch (and after it).
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
                                  T* __restrict__ out, int* __restrict__ tickets,
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
  const int active = (int)((ctx + chunk - 1) / chunk);  // splits holding keys
  if (split >= active) return;
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
  if (last_to_arrive(tickets + blockIdx.x * gridDim.y + blockIdx.y, active))
    merge_rows<T>(part_acc, part_ml, out, b, kvh, row0, rows - row0 < rb ? rows - row0 : rb,
                  m_tokens, hq, hkv, d, splits, active);
}

#define PARTIAL_ENTRY(SUFFIX, T)                                                                \
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
      float* part_acc, float* part_ml, T* out, int* tickets, int m_tokens, int hq, int hkv,    \
      int d, int rb, int tile, int tpd, float scale) {                                         \
    attn_partial_impl<T>(q, k_cache, v_cache, slots, positions, stride_slot, stride_pos,       \
                         part_acc, part_ml, out, tickets, m_tokens, hq, hkv, d, rb, tile, tpd, \
                         scale);                                                               \
  }

PARTIAL_ENTRY(bf16, bf16_t)
PARTIAL_ENTRY(f32, float)
