// Merge the per-split partial softmax results of decode attention (attn_decode in
// decode_attention.cu, attn_partial in attention_partial.cu; layout in common.cuh) into the
// output. Those kernels merge in their last block to finish (common.cuh's merge_rows); this
// separate launch does the same merge, one row per block, for a caller that wants it apart.
//
// attn_combine: grid (B*Hkv*R) for the R = M * Hq / Hkv query rows of a kv head, a multiple of
// 32 threads (D / 4 keeps each busy); splits <= 64, D % 4 == 0 -> out [B, M, Hq, D] in T.
#include "common.cuh"
#include "pdl.cuh"

template <typename T>
__device__ void attn_combine_impl(const float* __restrict__ part_acc,
                                  const float* __restrict__ part_ml, T* __restrict__ out,
                                  int m_tokens, int hq, int hkv, int d, int splits) {
  const int rows = m_tokens * (hq / hkv);
  const int bk = blockIdx.x / rows;  // b * hkv + kvh
  merge_rows<T>(part_acc, part_ml, out, bk / hkv, bk % hkv, blockIdx.x % rows, 1, m_tokens, hq,
                hkv, d, splits, splits);
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
