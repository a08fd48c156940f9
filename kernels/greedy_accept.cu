// Greedy speculative acceptance: the longest prefix of the draft the target agrees with.
//
// draft [B, K] int64 (the draft's proposals), target [B, K+1] int64 (the target's argmax at
// each of the K+1 verified positions) -> accepted [B] int64 = largest n with
// draft[b, :n] == target[b, :n], next [B] int64 = target[b, n] (the correction on a
// rejection, the bonus token when all K were accepted). One thread per sequence.
extern "C" __global__ void greedy_accept(const long long* __restrict__ draft,
                                         const long long* __restrict__ target,
                                         long long* __restrict__ accepted,
                                         long long* __restrict__ next, int batch, int k) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const long long* d = draft + (long long)b * k;
  const long long* t = target + (long long)b * (k + 1);
  int n = 0;
  while (n < k && d[n] == t[n]) ++n;
  accepted[b] = n;
  next[b] = t[n];
}
