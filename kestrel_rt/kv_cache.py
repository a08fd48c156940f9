"""The KV cache: preallocated K/V tensors, per-slot lengths, slot allocation and rollback.

One cache per backend (per model). A *slot* is a row of the cache that one sequence owns
while it runs. Lengths live on the host (the source of truth, used for capacity checks and
for building a step); every forward builds a `Step` whose device tensors say where each
sequence's new tokens go. Rollback is just setting a slot's length back: entries past the
length are never read, and the next forward overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel_sim.errors import KestrelError


class ContextFullError(KestrelError):
    """A sequence would grow past the cache's max_len (the context)."""


@dataclass(frozen=True)
class Step:
    """Where the M new tokens of each of B sequences sit, for one forward.

    All tensors are int64 on the backend's device (static shapes for a given B, M so a
    CUDA-graph backend can keep them in fixed buffers).
    """

    slots: torch.Tensor  # [B] cache row of each sequence
    start: torch.Tensor  # [B] tokens already in the cache before this step
    n_new: torch.Tensor  # [B] valid new tokens (<= M); rows i >= n_new[b] are padding
    positions: torch.Tensor  # [B, M] start[b] + i: RoPE position and cache index of token i
    max_ctx: int  # host bound: max over b of start[b] + M (the torch backend's batched
    # attention, on CUDA, gathers this many keys per sequence; on the CPU each sequence
    # reads its own start[b] + M in place)


class KVCache:
    """K and V for every layer: [layers, slots, max_len, kv_heads, head_dim] each."""

    def __init__(
        self, layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        shape = (layers, num_slots, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.lengths = [0] * num_slots  # host truth
        self._free = list(range(num_slots - 1, -1, -1))

    # -- slots -------------------------------------------------------------------------
    def can_allocate(self) -> bool:
        return bool(self._free)

    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot, emptied (length 0)."""
        if not self._free:
            raise RuntimeError(f"KV cache has no free slot (all {self.num_slots} in use)")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"KV slot {slot} freed twice")
        self.lengths[slot] = 0
        self._free.append(slot)

    # -- lengths -----------------------------------------------------------------------
    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything in `slot` past `length` tokens (speculative rejection)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"rollback of slot {slot} to {length}: has {self.lengths[slot]}")
        self.lengths[slot] = length

    def check(self, slots: list[int], m: int, n_new: list[int]) -> list[int]:
        """The current length of each slot, after checking M new tokens fit (n_new[b] valid)."""
        start = [self.lengths[s] for s in slots]
        for s, st, n in zip(slots, start, n_new):
            if not 0 < n <= m:
                raise ValueError(f"slot {s}: n_new={n} must be in 1..{m}")
            if st + m > self.max_len:
                raise ContextFullError(
                    f"sequence in KV slot {s} has {st} tokens and {m} new ones: more than the "
                    f"cache's max_len {self.max_len} (the context); expected at most "
                    f"{self.max_len - st} new tokens"
                )
        return start

    def step(self, slots: list[int], m: int, n_new: list[int], static: bool = False) -> Step:
        """The Step for M new tokens per slot (n_new[b] of them valid); checks capacity.

        static=True sets max_ctx to max_len, so attention shapes do not depend on lengths
        (for CUDA-graph capture: copy the Step's tensors into the captured buffers)."""
        start = self.check(slots, m, n_new)
        dev = self.device
        start_t = torch.tensor(start, dtype=torch.long, device=dev)  # [B]
        positions = start_t[:, None] + torch.arange(m, device=dev)[None, :]  # [B, M]
        return Step(
            slots=torch.tensor(slots, dtype=torch.long, device=dev),
            start=start_t,
            n_new=torch.tensor(n_new, dtype=torch.long, device=dev),
            positions=positions,
            max_ctx=self.max_len if static else max(start) + m,
        )

    def advance(self, slots: list[int], n_new: list[int]) -> None:
        """Count the valid new tokens of a finished forward."""
        for s, n in zip(slots, n_new):
            self.lengths[s] += n
