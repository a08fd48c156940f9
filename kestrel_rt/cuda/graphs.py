"""CUDA graphs of decode, verify and prefill forwards, per shape bucket, with static buffers.

    model = GraphModel(shape, weights, CupyBackend("cuda", torch.bfloat16))
    model.allocate_kv(num_slots, max_len)      # reserves one extra scratch slot for padding
    model.forward(tokens, slots)               # same contract as Qwen3Model.forward

A forward of B sequences x M new tokens replays a graph where the backend says the shape runs
without host syncs (`CupyBackend.graph_safe`): decode and verify (M <= max_m) with the batch
padded up to a bucket (1, 2, 4, ..., 64; padding rows write K/V only into the scratch slot),
and a one-sequence prefill with its tokens padded up to a PREFILL_BUCKETS length (padding
tokens are not read back and write K/V only past the sequence's length), its attention over
the next power of two of cached keys (an eager prefill is bound by the host's Python:
docs/performance.md has the measurement). The
first call of a shape runs eagerly on the capture stream (its real result, which also warms
up cuBLAS and compiles the kernels), then the same computation is captured; later calls
copy the Step into the static buffers with one host-to-device copy (tokens already on the
device are copied there device to device, or not at all when they are the buffer itself)
and replay. `forward(..., greedy=True)` captures the argmax too (Backend.greedy_tokens): a
decode step's token ids come back in the graph's token input, ready for the next replay;
`forward_greedy` also has the argmax kernel write them into pinned host memory (two halves,
alternate replays), so an overlapped decode loop reads them with no copy on the stream (a
device-to-host copy there cost ~10 us per step on the H200: docs/performance.md).
Anything else (larger batches; a MoE prefill, unless the backend's moe_prefill_graphs option
puts its experts on the capture-safe grouped path) runs eagerly: Qwen3Model.forward itself.

`warm_steps` captures ahead of a run, on the scratch slot only, the graphs its forwards will
replay (a capture inside a run stalls it: ~100 ms for a prefill graph of an 8B model on the
H200); kestrel_rt/cuda/graph_shapes.py lists the prefill graphs chunks can reach.
"""

from __future__ import annotations

import time

import torch

from kestrel_rt.cuda.graph_shapes import (
    BUCKETS,
    MAX_M,
    PREFILL_BUCKETS,
    PREFILL_MIN_KEYS,
    prefill_keys,
)
from kestrel_rt.cuda.ops import Unsupported
from kestrel_rt.kv_cache import KVCache, Step
from kestrel_rt.model import Chosen, Qwen3Model


class Captured:
    """One captured forward: its graph, its static input buffer and output; a greedy graph
    also writes its token ids into `host` (pinned [2, rows], the half the parity in its
    input buffer names; None: copied back instead) and `parity` is the half its next replay
    writes."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: torch.Tensor, step: Step,
                 tokens: torch.Tensor, out: torch.Tensor, host: torch.Tensor | None) -> None:
        self.graph, self.inputs, self.step, self.tokens, self.out = graph, inputs, step, tokens, out
        self.host, self.parity = host, 1  # the eager run before the capture wrote half 0


class GraphModel(Qwen3Model):
    """Qwen3Model whose decode / verify forwards replay CUDA graphs (backend: CupyBackend)."""

    def __init__(self, *args, buckets: tuple[int, ...] = BUCKETS, max_m: int = MAX_M,
                 prefill_buckets: tuple[int, ...] = PREFILL_BUCKETS,
                 prefill_min_keys: int = PREFILL_MIN_KEYS, **kwargs):
        super().__init__(*args, **kwargs)
        self.buckets = tuple(sorted(buckets))
        self.max_m = max_m
        self.prefill_buckets = tuple(sorted(prefill_buckets))
        self.prefill_min_keys = prefill_min_keys
        # (rows, new tokens, last_only, greedy, keys attention reads) -> its graph
        self.graphs: dict[tuple[int, int, bool, bool, int], Captured] = {}
        self.scratch_slot: int | None = None
        self.replays = 0  # forwards served by a graph replay (for tests and reports)
        self.captures, self.capture_s = 0, 0.0  # graphs captured, and the host time it took

    def allocate_kv(self, num_slots: int, max_len: int) -> KVCache:
        """A cache of num_slots usable slots plus one scratch slot that padding rows write."""
        kv = self.backend.allocate_kv(num_slots + 1, max_len)
        taken = [kv.allocate() for _ in range(num_slots + 1)]
        self.scratch_slot = taken[-1]
        for s in reversed(taken[:-1]):
            kv.free(s)
        self.graphs.clear()  # captured graphs point into the old cache
        return kv

    def warm(self, batches: tuple[int, ...] = (1,), new_tokens: tuple[int, ...] = (1,),
             prefill: tuple[int, ...] = (32,)) -> int:
        """warm_steps of the greedy prefill of each prompt length in `prefill`, then of each
        batch x M in new_tokens (decode: M = 1, verify: k + 1); graphs captured."""
        steps = [(1, min(n, self.kv.max_len), True, 0) for n in prefill]
        return self.warm_steps(steps + [(b, m, False, 0) for b in batches for m in new_tokens])

    @torch.inference_mode()
    def warm_steps(self, steps) -> int:
        """Compile and capture now what a run will need, on the scratch slot only: the greedy
        graph of each step (rows, M, last_only, start), a forward of [rows, M] new tokens
        after `start` cached ones, not yet captured (a one-sequence step with no graph runs
        eagerly at start 0 instead: the prefill path's kernels and cuBLAS warm up either
        way; others are passed over). Returns how many graphs it captured."""
        kv, scratch = self.kv, self.scratch_slot
        before = self.captures
        for rows, m, last_only, start in steps:
            if start + m > kv.max_len:
                continue
            shape = self._shape(rows, m, last_only, [start])
            if shape is None:
                if rows != 1 or not last_only or start:
                    continue
            elif _key(shape, last_only, True) in self.graphs:
                continue
            kv.rollback(scratch, 0)
            kv.advance([scratch], [start])  # its cached tokens: whatever the scratch slot holds
            self.forward(torch.zeros(rows, m, dtype=torch.long), [scratch] * rows,
                         last_only=last_only, greedy=True)
            kv.rollback(scratch, 0)
        return self.captures - before

    def _bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def _shape(self, B: int, M: int, last_only: bool, start: list[int]
               ) -> tuple[int, int, int] | None:
        """(rows, new tokens, keys attention reads) a forward of [B, M] replays at, or None
        (eager): decode and verify (M <= max_m) at the batch's bucket (the attention kernel
        reads each sequence's own length); a one-sequence prefill at its length's bucket,
        where the padded chunk still fits the cache (its last token's result only), its
        torch attention over the next power of two of keys that holds the chunk (at least
        prefill_min_keys: prefill_keys)."""
        safe = getattr(self.backend, "graph_safe", None)
        if safe is None or self.scratch_slot is None:
            return None
        max_len = self.kv.max_len
        if M <= self.max_m:
            bucket = self._bucket(B)
            return (bucket, M, max_len) if bucket is not None and safe(bucket, M) else None
        if B != 1 or not last_only:
            return None
        bucket = next((m for m in self.prefill_buckets if m >= M), None)
        if bucket is None or start[0] + bucket > max_len or not safe(1, bucket):
            return None
        return 1, bucket, prefill_keys(start[0], bucket, max_len, self.prefill_min_keys)

    @torch.inference_mode()
    def forward(self, tokens, slots, n_new=None, last_only=False, greedy=False):
        """Qwen3Model.forward, by a graph replay where the shape is graphable. With greedy,
        the token ids returned by a replay are a view of the graph's static buffer, valid
        until the next forward of the same shape (read or copy them before: what a decode
        loop does); for M = 1 that buffer is the graph's own token input, so passing the
        result back as the next step's tokens copies nothing."""
        return self._run(tokens, slots, n_new, last_only, greedy)[0]

    @torch.inference_mode()
    def forward_greedy(self, tokens, slots, n_new=None, last_only=False) -> Chosen:
        """Qwen3Model.forward_greedy; by a replay, the graph's argmax kernel writes the ids
        into pinned host memory itself (no copy back on the stream): `Chosen.host` is valid
        until two more replays of the same shape (read it before: what a decode loop does)."""
        out, host = self._run(tokens, slots, n_new, last_only, True)
        if host is None:
            return Chosen.copy_back(out)
        ready = torch.cuda.Event()
        ready.record()
        return Chosen(out, host, ready)

    def _run(self, tokens, slots, n_new, last_only, greedy):
        """(forward's result, its token ids in pinned host memory or None)."""
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor(tokens, dtype=torch.long)
        B, M = tokens.shape
        slots = list(slots)
        n_new = [M] * B if n_new is None else list(n_new)
        kv = self.kv
        start = kv.check(slots, M, n_new)
        shape = self._shape(B, M, last_only, start)
        if shape is None:
            return super().forward(tokens, slots, n_new, last_only, greedy), None
        bucket, Mb, _ = shape  # M real tokens per row at most, padded to Mb (fits: _shape)
        pad = bucket - B
        starts = start + [0] * pad
        key = _key(shape, last_only, greedy)
        cap = self.graphs.get(key)
        parity = 0 if cap is None else cap.parity
        # slots | start | n_new | positions | parity, one pinned host tensor: its copy to the
        # device is asynchronous (a pageable one may wait for the stream, which would stall
        # an overlapped decode loop); torch's pinned allocator keeps it until the copy is done
        meta = torch.tensor(
            slots + [self.scratch_slot] * pad + starts + n_new + [Mb] * pad
            + [st + i for st in starts for i in range(Mb)] + [parity], dtype=torch.long,
            pin_memory=self.device.type == "cuda")
        if cap is None:
            out, cap = self._capture(key, tokens, meta)
            out = out[:B]
        else:
            cap.inputs.copy_(meta, non_blocking=True)
            mine = cap.tokens[:B, :M]  # (a prefill's columns past M: padding, not read)
            if not (tokens.data_ptr() == mine.data_ptr() and tokens.stride() == mine.stride()):
                mine.copy_(tokens, non_blocking=True)  # device tokens stay on the device
            cap.graph.replay()
            cap.parity ^= 1
            self.replays += 1
            # the static output is overwritten by the next replay: logits are copied out,
            # greedy token ids (a few bytes, read at once by their caller) are not
            out = cap.out[:B] if greedy else cap.out[:B].clone()
        kv.advance(slots, n_new)
        host = None
        if cap.host is not None:
            rows = B if last_only else B * M
            host = cap.host[parity, :rows].view(out[:, 0].shape if last_only else out.shape)
        return (out[:, 0] if last_only else out), host

    def _capture(self, key: tuple[int, int, bool, bool, int], tokens: torch.Tensor,
                 meta: torch.Tensor) -> tuple[torch.Tensor, Captured]:
        """Run the forward eagerly on the capture stream (this call's result), then capture
        it. A greedy forward writes its ids to pinned host memory too where the backend's
        argmax can (else its caller copies them back)."""
        t0 = time.perf_counter()
        bucket, M, last_only, greedy, keys = key
        be = self.backend
        inputs = meta.to(self.device)
        static_tokens = torch.zeros(bucket, M, dtype=torch.long, device=self.device)
        static_tokens[: tokens.shape[0], : tokens.shape[1]] = tokens.to(self.device)
        step = static_step(inputs, bucket, M, keys)
        # greedy decode (one token in, one out per row) writes its choice over its own input;
        # every other greedy graph into a buffer of its own, made here, outside the capture:
        # the graphs of a backend share one memory pool, where an output allocated during
        # a capture may lie in an earlier-captured graph's scratch, and that graph's next
        # replay would overwrite it while its caller still holds it (a verify's ids under
        # the prompt chunks that ride along with it)
        into = None
        if greedy:
            into = static_tokens if M == 1 else torch.zeros(
                bucket, 1 if last_only else M, dtype=torch.long, device=self.device)
        host = None
        if greedy:
            rows = bucket if last_only else bucket * M
            host = (torch.zeros(2, rows, dtype=torch.long, pin_memory=True), inputs[-1:])
        stream = be.capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            try:
                eager = self.compute(static_tokens, step, last_only, greedy, None, host)
            except (Unsupported, NotImplementedError):  # no argmax kernel for these logits
                host = None
                eager = self.compute(static_tokens, step, last_only, greedy)
            eager = eager.clone()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        stream.synchronize()
        if be.graph_pool is None:
            be.graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another worker's thread (disaggregated serving, kestrel_rt/serve)
        # may launch, allocate or synchronize on its own stream while this one captures;
        # the default (global) mode would invalidate this capture for it
        with torch.cuda.graph(graph, pool=be.graph_pool, stream=stream,
                              capture_error_mode="thread_local"):
            out = self.compute(static_tokens, step, last_only, greedy, into, host)
        cap = Captured(graph, inputs, step, static_tokens, out,
                        None if host is None else host[0])
        self.graphs[key] = cap
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return eager, cap


def _key(shape: tuple[int, int, int], last_only: bool, greedy: bool
         ) -> tuple[int, int, bool, bool, int]:
    """A graph's key: (rows, new tokens, last_only, greedy, keys) of the _shape it runs at."""
    rows, m, keys = shape
    return rows, m, bool(last_only), bool(greedy), keys


def static_step(inputs: torch.Tensor, bucket: int, m: int, max_ctx: int) -> Step:
    """A Step whose tensors are views into the static metadata buffer."""
    slots = inputs[:bucket]
    start = inputs[bucket: 2 * bucket]
    n_new = inputs[2 * bucket: 3 * bucket]
    positions = inputs[3 * bucket: 3 * bucket + bucket * m].view(bucket, m)
    return Step(slots=slots, start=start, n_new=n_new, positions=positions, max_ctx=max_ctx)
