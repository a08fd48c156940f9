"""A worker's KV: the logical token budget its scheduler enforces (the simulator's KVPool,
charged the same way) and the physical slots of its models' caches.

Charges, as kestrel_sim/sim/kv.py: under `preempt` a request holds its tokens (prompt +
generated) and grows as it emits; under `wait` it holds prompt + output + k + 1 from
admission, so nothing is ever evicted. Physically each running request owns one slot (a
row of max_len tokens) in every model of its worker (target and draft); the slot index is
the same in all of them. How many slots a worker gets is planned by
kestrel_sim/sim/slots.py, for the runtime and the simulator alike.
"""

from __future__ import annotations

from kestrel_rt.kv_cache import KVCache
from kestrel_rt.serve.requests import Sequence
from kestrel_rt.serve.settings import ServeSettings


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
