// Merge the per-split partial softmax results of decode attention (attn_decode in
// decode_attention.cu, attn_partial in attention_partial.cu; same layout) into the output.
//
// Partials of row (b, kvh, r) (r = m * G + g of the kv head's R = M * G query rows) and split s:
// acc [.., D] unnormalised, (max, sum) of its scores. attn_combine: grid (B*Hkv*R), at least
// max(splits, 32) threads; splits <= 64 -> out [B, M, Hq, D] in T.
#include "common.cuh"
#include "pdl.cuh"

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

#define COMBINE_ENTRY(SUFFIX, T)                                                               \
  extern "C" __global__ void attn_combine_##SUFFIX(const float* part_acc, const float* part_ml, \
                                                   T* out, int m_tokens, int hq, int hkv,      \
                                                   int d, int splits) {                        \
    pdl_trigger();                                                                             \
    pdl_wait();                                                                                \
    attn_combine_impl<T>(part_acc, part_ml, out, m_tokens, hq, hkv, d, splits);                \
  }

COMBINE_ENTRY(bf16, bf16_t)
COMBINE_ENTRY(f32, float)
