"""A worker's KV: the logical token budget its scheduler enforces (the simulator's KVPool,
charged the same way) and the physical slots of its models' caches.

Charges, as kestrel_sim/sim/kv.py: under `preempt` a request holds its tokens (prompt +
generated) and grows as it emits; under `wait` it holds prompt + output + k + 1 from
admission, so nothing is ever evicted. Physically each running request owns one slot (a
row of max_len tokens) in every model of its worker (target and draft); the slot index is
the same in all of them.
"""

from __future__ import annotations

from kestrel_rt.kv_cache import KVCache
from kestrel_rt.serve.requests import Sequence
from kestrel_rt.serve.settings import ServeSettings
from kestrel_sim.errors import KestrelError


def charge(s: ServeSettings, seq: Sequence, tokens: int) -> int:
    """KV tokens a request is charged on admission: `tokens`, or its full reservation."""
    return tokens if s.preempt else reservation(s, seq)


def reservation(s: ServeSettings, seq: Sequence) -> int:
    """What `wait` reserves: prompt + output + k + 1."""
    return seq.prompt_len + seq.output_len + s.k + 1


class SlotPool:
    """The usable slots of a worker's caches (a GraphModel's scratch slot is not one)."""

    def __init__(self, caches: list[KVCache], num_slots: int):
        self.caches = caches
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))

    def can_allocate(self) -> bool:
        return bool(self.free_slots)

    def allocate(self) -> int:
        """A free slot, emptied in every cache."""
        slot = self.free_slots.pop()
        for kv in self.caches:
            kv.rollback(slot, 0)
        return slot

    def free(self, slot: int) -> None:
        if slot in self.free_slots:
            raise RuntimeError(f"KV slot {slot} freed twice")
        self.free_slots.append(slot)


def slots_per_worker(want: int, least: int, workers: int, slot_bytes: int, weights: int,
                     free: int | None, longest: int, reserve: int = 0) -> int:
    """Slots each worker's caches get: `want`, fewer if the device's `free` bytes cannot
    hold that many next to the weights, never fewer than `least` (max_batch: refused).
    Each worker's caches hold one scratch slot more (a GraphModel's padding rows write it),
    and `reserve` bytes a worker stay free for its activations, CUDA graph pools and
    workspaces (without them a plan that filled the device ran out of memory mid-build)."""
    if free is None:
        return want
    room = free - weights - workers * reserve
    fit = room // (workers * slot_bytes) - 1 if slot_bytes else want
    if fit < least:
        raise KestrelError(
            f"the KV caches do not fit: each worker needs serving.max_batch = {least} slots of "
            f"{longest} tokens (the longest request + k + 1; the runtime's cache is one row "
            f"per sequence) and a scratch slot, {workers * (least + 1) * slot_bytes / 1e9:.1f} "
            f"GB beside {weights / 1e9:.1f} GB of weights and {workers * reserve / 1e9:.1f} GB "
            f"of workspace, but the device has {free / 1e9:.1f} GB free: "
            "lower serving.max_batch or shorten the requests"
        )
    return int(min(want, fit))
