"""The shapes a GraphModel (kestrel_rt/cuda/graphs.py) captures its graphs at: batch buckets,
prefill length buckets, and the keys a prefill graph's attention reads; and the prefill
graphs a run's chunks can reach, so that a warm-up captures them all before the clock starts
(kestrel_rt/serve/forward.py warm_up). Plain Python: no torch.

    prefill_keys(start=2048, bucket=128, max_len=5215)                # 4096
    prefill_warm_shapes(PREFILL_BUCKETS, 5215, 2048, can_start_mid=True)
        # [(32, 2048), ..., (2048, 2048), (32, 4096), ..., (2048, 5215)]: 36 graphs
"""

from __future__ import annotations

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_M = 16  # most tokens per sequence a decode / verify graph takes (more: a prefill)
# Prompt lengths a one-sequence prefill is padded up to and replayed at (at most a third of
# padding from 64 on); longer prompts, or chunks that would pad past the cache, run eagerly.
PREFILL_BUCKETS = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                   6144, 8192)
# Keys a prefill graph's attention reads, at least (then the next power of two): one graph per
# length bucket covers every chunk of a cache this long, so chunks at growing contexts do not
# each capture their own mid-run.
PREFILL_MIN_KEYS = 2048


def prefill_keys(start: int, bucket: int, max_len: int, min_keys: int = PREFILL_MIN_KEYS) -> int:
    """Keys a one-sequence prefill graph's attention reads for a chunk padded to `bucket`
    tokens after `start` cached ones: the next power of two that holds them, at least
    min_keys, at most the cache's max_len."""
    return min(max_len, max(min_keys, 1 << (start + bucket - 1).bit_length()))


def prefill_warm_shapes(prefill_buckets: tuple[int, ...], max_len: int, longest_chunk: int,
                        can_start_mid: bool, min_keys: int = PREFILL_MIN_KEYS
                        ) -> list[tuple[int, int]]:
    """(bucket, keys) of every prefill graph that chunks of up to longest_chunk tokens replay
    in a cache of max_len: each length bucket a chunk can pad up to (those whose padded chunk
    fits the cache), at start 0 only, or where a chunk can start anywhere (a prompt longer
    than a chunk, a chunk cut by max_batched_tokens, a recompute after a preemption) at every
    keys level a start can reach (prefill_keys). Ordered by keys, then bucket."""
    buckets = sorted(prefill_buckets)
    shapes = set()
    for below, bucket in zip([0, *buckets], buckets):
        if below >= longest_chunk or bucket > max_len:  # no chunk pads up to it, or none fits
            continue
        if not can_start_mid:
            shapes.add((bucket, prefill_keys(0, bucket, max_len, min_keys)))
            continue
        # the keys level changes only past a power of two: a start ending the padded chunk
        # on one, just past one, or at max_len reaches every level
        ends = {bucket, max_len} | {p + d for p in (1 << i for i in range(max_len.bit_length()))
                                    for d in (0, 1) if bucket <= p + d <= max_len}
        shapes |= {(bucket, prefill_keys(end - bucket, bucket, max_len, min_keys))
                   for end in ends}
    return sorted(shapes, key=lambda shape: (shape[1], shape[0]))
