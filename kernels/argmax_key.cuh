// One candidate of a greedy choice as one 64-bit key, so that the largest key is torch.argmax's
// choice (the first index of the maximum; a NaN above every number, the first NaN winning):
// the value's bits made orderable as unsigned (a NaN above +inf, -0 as +0) over the index's
// complement (ties: the smaller index). Every real key is above 0, so 0 stands for "none".
// Used by kernels/argmax.cu and by the bulk gemv's ARGMAX epilogue (kernels/gemv_bulk.cu).
#pragma once

__device__ __forceinline__ unsigned long long argmax_key(float v, int n) {
  unsigned int b = __float_as_uint(v);
  if (v != v) b = 0xffffffffu;
  else if (v == 0.f) b = 0x80000000u;  // -0 == +0
  else b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return ((unsigned long long)b << 32) | (unsigned int)~n;
}

// The index a key holds.
__device__ __forceinline__ long long argmax_index(unsigned long long key) {
  return (long long)(unsigned int)~(unsigned int)key;
}

__device__ __forceinline__ unsigned long long key_max(unsigned long long a, unsigned long long b) {
  return a > b ? a : b;
}
