// Decode / verify attention over the KV cache for few query rows: M new query tokens per
// sequence, grouped-query heads, per-sequence lengths, causal within the new tokens, split
// over the context (flash-decoding: partial softmax per split; the last split block of a kv
// head to finish merges them). Optionally with the q/k RMSNorm + RoPE of qk_norm_rope.cu fused
// in (attn_decode_rope_*).
//
// Cache of one layer: k_cache, v_cache [slots, max_len, Hkv, D] (element (s, p, h, d) at
// s * stride_slot + p * stride_pos + h * D + d). Step: slots [B] int64, positions [B, M] int64
// (position and cache index of each new token, consecutive: positions[b, m] = start[b] + m).
// Key p is visible to query (b, m) iff p <= positions[b, m].
//
// attn_decode:      R = M * G <= RB <= 8 query rows (G = Hq / Hkv) of one kv head, D = 32 * DL
//                   in {64, 128, 256}: one warp per key, q rows and accumulators in registers.
//                   Writes unnormalised acc [.., D] and (max, sum) per (b, kvh, row, split)
//                   to the workspace, then the last block of (b, kvh) to finish merges them
//                   into out [B, M, Hq, D] (common.cuh's last_to_arrive, merge_rows).
// attn_decode_rope: the same, with q and the step's new k given before RMSNorm and RoPE:
//                   common.cuh's head_norm_rope (the helper qk_norm_rope.cu calls) applies
//                   them in registers, so the result and the cache equal qk_norm_rope followed
//                   by attn_decode, bit for bit.
#include "common.cuh"
#include "pdl.cuh"

#define DECODE_WARPS 4

// A diagnostic build (bench/attention_probe.py compiles this file with -DDECODE_PROBE; the
// runtime never does): thread 0 of each block that holds keys appends one record of
// PROBE_WORDS int64 to probe_rec: blockIdx.x, blockIdx.y, %smid, %globaltimer (ns) at entry,
// then clock64 cycles since entry at each mark: after the PDL wait, after the RoPE prologue,
// after warp 0's key loop, after the partials are stored, after the arrival ticket, after the
// merge (-1 where the block does not merge); last, ns and cycles since entry at the save.
#ifdef DECODE_PROBE
#define PROBE_MARKS 6
#define PROBE_WORDS (6 + PROBE_MARKS)
#define PROBE_RECORDS 65536
__device__ unsigned int probe_n;
__device__ long long probe_rec[PROBE_RECORDS * PROBE_WORDS];
#define PROBE_START()                                                                          \
  long long probe_c0 = clock64(), probe_t0 = 0, probe_m[PROBE_MARKS];                          \
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(probe_t0));                                 \
  for (int i = 0; i < PROBE_MARKS; ++i) probe_m[i] = -1;
#define PROBE_MARK(i) probe_m[i] = clock64() - probe_c0;
#define PROBE_SAVE()                                                                           \
  if (threadIdx.x == 0) {                                                                      \
    const unsigned int at = atomicAdd(&probe_n, 1u);                                           \
    if (at < PROBE_RECORDS) {                                                                  \
      unsigned int smid;                                                                       \
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));                                        \
      long long* r = probe_rec + (long long)at * PROBE_WORDS;                                  \
      r[0] = blockIdx.x;                                                                       \
      r[1] = blockIdx.y;                                                                       \
      r[2] = smid;                                                                             \
      r[3] = probe_t0;                                                                         \
      for (int i = 0; i < PROBE_MARKS; ++i) r[4 + i] = probe_m[i];                             \
      long long t1;                                                                            \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));                                   \
      r[4 + PROBE_MARKS] = t1 - probe_t0;                                                      \
      r[5 + PROBE_MARKS] = clock64() - probe_c0;                                               \
    }                                                                                          \
  }
#else
#define PROBE_START()
#define PROBE_MARK(i)
#define PROBE_SAVE()
#endif

// attn_decode's ROPE prologue. Items: the new keys this block reads (tokens key0 .. key0 +
// nkeys of sequence b), then its q rows; item it goes to warp it % DECODE_WARPS. Each warp
// first loads all its items (x, cos, sin), then normalises and rotates them (head_norm_rope):
// q rows into s_q[r], keys into s_knew[mm] and, with v, into the cache. Ends at a barrier.
template <typename T, int DL, int RB>
__device__ __forceinline__ void rope_prologue(
    const T* __restrict__ q, long long q_st, const T* __restrict__ k_new, long long k_st,
    const T* __restrict__ v_new, long long v_st, T* __restrict__ k_cache, T* __restrict__ v_cache,
    const T* __restrict__ q_norm, const T* __restrict__ k_norm, const T* __restrict__ cos_t,
    const T* __restrict__ sin_t, float eps, const long long* __restrict__ pos_b, int b,
    int m_tokens, int kvh, int g_size, int rows, int key0, int nkeys, long long lane_base,
    long long stride_pos, float (*s_q)[32 * DL], float (*s_knew)[32 * DL]) {
  constexpr int D = 32 * DL;
  constexpr int J = (2 * RB + DECODE_WARPS - 1) / DECODE_WARPS;  // items per warp, at most
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int items = nkeys + rows;
  const long long tok0 = (long long)b * m_tokens;  // token row of (b, 0)
  const int lane_off = lane * DL, pair_off = (lane & 15) * DL;
  float qw[DL], kw[DL], x[J][DL], c[J][DL], s[J][DL];
  load_lane<T, DL>(q_norm + lane_off, qw);
  load_lane<T, DL>(k_norm + lane_off, kw);
#pragma unroll
  for (int j = 0; j < J; ++j) {  // every load in flight before any math
    const int it = warp + DECODE_WARPS * j;
    if (it < items) {  // warp-uniform
      const int mm = it < nkeys ? key0 + it : (it - nkeys) / g_size;
      const T* src = it < nkeys
          ? k_new + (tok0 + mm) * k_st + kvh * D
          : q + (tok0 + mm) * q_st + (kvh * g_size + (it - nkeys) % g_size) * D;
      load_lane<T, DL>(src + lane_off, x[j]);
      load_lane<T, DL>(cos_t + pos_b[mm] * D + pair_off, c[j]);
      load_lane<T, DL>(sin_t + pos_b[mm] * D + pair_off, s[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int it = warp + DECODE_WARPS * j;
    if (it < items) {  // warp-uniform
      const bool is_key = it < nkeys;
      float w[DL];
#pragma unroll
      for (int i = 0; i < DL; ++i) w[i] = is_key ? kw[i] : qw[i];
      head_norm_rope<T, DL>(x[j], w, c[j], s[j], lane, eps);
      if (is_key) {
        const int mm = key0 + it;
#pragma unroll
        for (int i = 0; i < DL; ++i) s_knew[mm][lane_off + i] = x[j][i];
        const long long at = lane_base + pos_b[mm] * stride_pos;  // this lane's elements
        store_lane<T, DL>(k_cache + at, x[j]);
        copy_lane<T, DL>(v_cache + at, v_new + (tok0 + mm) * v_st + kvh * D + lane_off);
      } else {
#pragma unroll
        for (int i = 0; i < DL; ++i) s_q[it - nkeys][lane_off + i] = x[j][i];
      }
    }
  }
  __syncthreads();
}

// Few query rows (R = M * G <= RB): one warp per key, no block barrier in the key loop. Lane l
// holds elements [l * DL, l * DL + DL) of q rows, K, V and the accumulators (D = 32 * DL).
// Grid (B * Hkv, splits), DECODE_WARPS warps. tickets [>= B * Hkv] int32, zero before the
// launch (and after it).
//
// q: [B*M, Hq*D] with token stride q_st. k_new / v_new (optional without ROPE): the step's new
// K/V [B*M, Hkv*D] (token strides k_st, v_st). When given, keys at positions >= positions[b, 0]
// are read from them rather than the cache, and the blocks of split 0 write them into the
// cache (no other block reads those entries), so no separate kv_write launch is needed.
// ROPE: q and k_new are raw (before RMSNorm and RoPE); q_norm, k_norm [D], cos_t, sin_t
// [max_pos, D] (16-byte aligned). A prologue (rope_prologue) spreads the block's q rows and
// the new keys it reads over its warps; each is normalised and rotated once, into shared
// memory, and each new key is written into the cache by the one block that reads it.
template <typename T, int DL, int RB, bool ROPE>
__device__ void attn_decode_impl(const T* __restrict__ q, long long q_st, T* __restrict__ k_cache,
                                 T* __restrict__ v_cache, const long long* __restrict__ slots,
                                 const long long* __restrict__ positions,
                                 long long stride_slot, long long stride_pos,
                                 float* __restrict__ part_acc, float* __restrict__ part_ml,
                                 T* __restrict__ out, int* __restrict__ tickets,
                                 int m_tokens, int hq, int hkv, float scale,
                                 const T* __restrict__ k_new, long long k_st,
                                 const T* __restrict__ v_new, long long v_st,
                                 const T* __restrict__ q_norm, const T* __restrict__ k_norm,
                                 const T* __restrict__ cos_t, const T* __restrict__ sin_t,
                                 float eps, int min_keys) {
  PROBE_START()
  constexpr int D = 32 * DL;
  __shared__ float s_acc[DECODE_WARPS][RB][D];
  __shared__ float s_ml[DECODE_WARPS][RB][2];
  __shared__ float s_knew[ROPE ? RB : 1][ROPE ? D : 1];  // ROPE: new keys, normalised, rotated
  const int g_size = hq / hkv;
  const int rows = m_tokens * g_size;
  const int b = blockIdx.x / hkv, kvh = blockIdx.x % hkv;
  const int split = blockIdx.y, splits = gridDim.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long* pos_b = positions + (long long)b * m_tokens;
  const long long first_new = k_new ? pos_b[0] : (long long)1 << 62;
  const long long ctx = pos_b[m_tokens - 1] + 1;
  // Keys per split: at least min_keys (>= one pass of the key loop, two keys per warp), so a
  // short context leaves the last splits empty (they return at once) and fewer partials to
  // merge, instead of a few keys in each.
  const long long least = min_keys > 2 * DECODE_WARPS ? min_keys : 2 * DECODE_WARPS;
  long long chunk = (ctx + splits - 1) / splits;
  chunk = chunk > least ? chunk : least;
  const int active = (int)((ctx + chunk - 1) / chunk);  // splits holding keys
  if (split >= active) return;
  const long long k_begin = (long long)split * chunk;
  const long long k_end = ctx < k_begin + chunk ? ctx : k_begin + chunk;
  const long long base = slots[b] * stride_slot + (long long)kvh * D + lane * DL;
  const long long new_off = (long long)b * m_tokens;  // token row of (b, 0) in k_new / v_new
  const int head_off = kvh * D + lane * DL;

  // PDL (kernels/pdl.cuh): the cached keys before the new tokens were written by earlier
  // steps, so fetch this block's share of them into L2 while the previous kernel (the qkv
  // projection) finishes; q and the new K/V are read, and the cache written, after the wait.
  for (long long key = k_begin + warp; key < k_end && key < first_new; key += DECODE_WARPS) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(k_cache + base + key * stride_pos));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(v_cache + base + key * stride_pos));
  }
  pdl_wait();
  PROBE_MARK(0)

  if constexpr (!ROPE) {
    if (k_new && split == 0) {  // the new K/V go into the cache
      for (int mm = warp; mm < m_tokens; mm += DECODE_WARPS) {
        const long long dst = base + pos_b[mm] * stride_pos;
        copy_lane<T, DL>(k_cache + dst, k_new + (new_off + mm) * k_st + head_off);
        copy_lane<T, DL>(v_cache + dst, v_new + (new_off + mm) * v_st + head_off);
      }
    }
  }

  float (*s_q)[D] = s_acc[0];  // ROPE: normalised q rows, until the key loop (then s_acc)
  if constexpr (ROPE) {
    const long long lo = k_begin > first_new ? k_begin : first_new;  // new keys read here
    rope_prologue<T, DL, RB>(q, q_st, k_new, k_st, v_new, v_st, k_cache, v_cache, q_norm,
                             k_norm, cos_t, sin_t, eps, pos_b, b, m_tokens, kvh, g_size, rows,
                             (int)(lo - first_new), k_end > lo ? (int)(k_end - lo) : 0,
                             base, stride_pos, s_q, s_knew);
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
    if (r < rows) {  // warp-uniform
      const int mm = r / g_size, g = r % g_size;
      if constexpr (ROPE) {
#pragma unroll
        for (int i = 0; i < DL; ++i) qr[r][i] = s_q[r][lane * DL + i];
      } else {
        load_lane<T, DL>(q + ((long long)b * m_tokens + mm) * q_st + (kvh * g_size + g) * D +
                             lane * DL,
                         qr[r]);
      }
#pragma unroll
      for (int i = 0; i < DL; ++i) qr[r][i] *= scale;
      last[r] = pos_b[mm];
    }
  }
  if constexpr (ROPE) __syncthreads();  // every warp holds its q rows: s_acc is free again
  PROBE_MARK(1)

  for (long long key = k_begin + warp; key < k_end; key += 2 * DECODE_WARPS) {
    float kv[2][DL], vv[2][DL];  // two keys' loads in flight per lane
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const long long kk = key + u * DECODE_WARPS;
      if (kk < k_end) {
        if (kk >= first_new) {
          const long long row = kk - first_new;  // new token mm of this sequence
          if constexpr (ROPE) {
#pragma unroll
            for (int i = 0; i < DL; ++i) kv[u][i] = s_knew[row][lane * DL + i];
          } else {
            load_lane<T, DL>(k_new + (new_off + row) * k_st + head_off, kv[u]);
          }
          load_lane<T, DL>(v_new + (new_off + row) * v_st + head_off, vv[u]);
        } else {
          load_lane<T, DL>(k_cache + base + kk * stride_pos, kv[u]);
          load_lane<T, DL>(v_cache + base + kk * stride_pos, vv[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const long long kk = key + u * DECODE_WARPS;
      if constexpr (RB >= 8) {
        // Eight rows: their dot products reduced together (warp_sum_rows: 7 + 2 shuffles,
        // then 8 broadcasts, all independent), then the online-softmax updates without
        // branches (a row past `rows` or past its last visible key keeps its state). With
        // four rows the per-row loop below measured faster (docs/performance.md).
        if (kk >= k_end) continue;  // warp-uniform
        float s[RB];
#pragma unroll
        for (int r = 0; r < RB; ++r) {
          s[r] = 0.f;
#pragma unroll
          for (int i = 0; i < DL; ++i) s[r] = fmaf(qr[r][i], kv[u][i], s[r]);
        }
        const float y = warp_sum_rows<RB>(s);  // lane l: row l / (32 / RB)
#pragma unroll
        for (int r = 0; r < RB; ++r) {
          const float sr = __shfl_sync(0xffffffffu, y, r * (32 / RB));
          const bool ok = kk <= last[r];  // visible (last[r] = -1 for r >= rows)
          const float m_new = ok ? fmaxf(m[r], sr) : m[r];
          const float sc = ok ? expf(m[r] - m_new) : 1.f, p = ok ? expf(sr - m_new) : 0.f;
          l[r] = l[r] * sc + p;
#pragma unroll
          for (int i = 0; i < DL; ++i)
            acc[r][i] = ok ? fmaf(p, vv[u][i], acc[r][i] * sc) : acc[r][i];
          m[r] = m_new;
        }
      } else {
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
  }
  PROBE_MARK(2)
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
  PROBE_MARK(3)
  const bool merges = last_to_arrive(tickets + blockIdx.x, active);
  PROBE_MARK(4)
  if (merges) {
    merge_rows<T>(part_acc, part_ml, out, b, kvh, 0, rows, m_tokens, hq, hkv, D, splits, active);
    PROBE_MARK(5)
  }
  PROBE_SAVE()
}

// One entry point per (dtype, D / 32, RB), without and with the fused norm + RoPE; same
// arguments (the norm ones are ignored without the RoPE).
#define DECODE_ENTRY(NAME, T, DL, RB, ROPE)                                                    \
  extern "C" __global__ void __launch_bounds__(32 * DECODE_WARPS) NAME(                        \
      const T* q, long long q_st, T* k_cache, T* v_cache, const long long* slots,              \
      const long long* positions, long long stride_slot, long long stride_pos,                 \
      float* part_acc, float* part_ml, T* out, int* tickets, int m_tokens, int hq, int hkv,    \
      float scale, const T* k_new, long long k_st, const T* v_new, long long v_st,             \
      const T* q_norm, const T* k_norm, const T* cos_t, const T* sin_t, float eps,             \
      int min_keys) {                                                                          \
    pdl_trigger();                                                                             \
    attn_decode_impl<T, DL, RB, ROPE>(q, q_st, k_cache, v_cache, slots, positions,             \
                                      stride_slot, stride_pos, part_acc, part_ml, out,         \
                                      tickets, m_tokens, hq, hkv, scale, k_new, k_st, v_new,   \
                                      v_st, q_norm, k_norm, cos_t, sin_t, eps, min_keys);      \
  }

#define DECODE_PAIR(SUFFIX, T, DL, RB)                                                         \
  DECODE_ENTRY(attn_decode_##SUFFIX##_d##DL##_r##RB, T, DL, RB, false)                         \
  DECODE_ENTRY(attn_decode_rope_##SUFFIX##_d##DL##_r##RB, T, DL, RB, true)

#define DECODE_ENTRIES(SUFFIX, T)                                                              \
  DECODE_PAIR(SUFFIX, T, 2, 2) DECODE_PAIR(SUFFIX, T, 2, 4) DECODE_PAIR(SUFFIX, T, 2, 8)       \
  DECODE_PAIR(SUFFIX, T, 4, 2) DECODE_PAIR(SUFFIX, T, 4, 4) DECODE_PAIR(SUFFIX, T, 4, 8)       \
  DECODE_PAIR(SUFFIX, T, 8, 2) DECODE_PAIR(SUFFIX, T, 8, 4) DECODE_PAIR(SUFFIX, T, 8, 8)

DECODE_ENTRIES(bf16, bf16_t)
DECODE_ENTRIES(f32, float)
