"""A worker: its models (target, and a draft when speculating), their KV slots, its logical
KV budget, the prompts it is prefilling and its running batch; its loop is `step` (plain
decode rounds run ahead of the host while nothing changes: ahead.py).

Roles, as the simulator's: `colocated` (prefill and decode, continuous batching), `prefill`
and `decode` (disaggregated). Every worker has its own model instances and KV caches on the
device it is placed on (placement.py), and its own CUDA stream there. Span worker names are
the simulator's ("gpu0/target", "prefill0/target", "decode1/target").
"""

from __future__ import annotations

import torch

from kestrel_rt.serve.ahead import decode_ahead, runs_ahead
from kestrel_rt.serve.forward import run_step
from kestrel_rt.serve.kv import SlotPool
from kestrel_rt.serve.postprocess import postprocess
from kestrel_rt.serve.queues import PrefillJob
from kestrel_rt.serve.requests import Sequence
from kestrel_rt.serve.scheduler import schedule
from kestrel_sim.sim.kv import KVPool


class Worker:
    def __init__(self, name: str, role: str, models: list, num_slots: int, kv_capacity: int,
                 draft_name: str | None = None, spec=None):
        self.name = name  # span worker name of the target
        self.role = role  # colocated | prefill | decode
        self.draft_name = draft_name  # span worker name of the draft, or None
        self.models = models  # [target] or [target, draft], KV caches allocated
        self.spec = spec  # a ServingDecoder over them (workers that run rounds), or None
        self.kv = KVPool(kv_capacity)  # the logical budget, the simulator's own class
        self.slots = SlotPool([m.kv for m in models], num_slots)
        self.prefilling: list[PrefillJob] = []  # admitted, prompt not fully prefilled yet
        self.batch: list[Sequence] = []  # running, in join order (the newest last)
        self.joined: list[Sequence] = []  # prefilled since the last round (join at the next)
        self.last_was_prefill = False  # the alternate schedule's turn
        self.in_flight: set[int] = set()  # requests whose round in flight the KV holds (ahead.py)
        self.round_s = 0.0  # the last run-ahead round's duration, host clock (ahead.py)
        self.rounds_ahead = 0  # rounds launched before the previous one's ids were read
        device = models[0].device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def target(self):
        return self.models[0]

    @property
    def draft(self):
        return self.models[1] if len(self.models) > 1 else None

    @property
    def batch_size(self) -> int:
        return len(self.batch) + len(self.joined)

    def join(self, seq: Sequence) -> None:
        self.joined.append(seq)

    def merge(self) -> list[Sequence]:
        """Move the joiners into the batch; returns them."""
        joined, self.joined = self.joined, []
        self.batch.extend(joined)
        if self.spec is not None:
            for seq in joined:
                if seq.spec is None:
                    seq.spec = self.spec.sequence(seq)
        return joined

    def step(self, eng) -> bool:
        """One turn of the worker's loop: schedule, run, postprocess. False when idle."""
        with eng.lock:
            eng.poll()  # arrivals due, KV hand-overs landed
            plan = schedule(eng, self)
            eng.observe(self, plan)  # None: idle until something changes
        if plan is None:
            return False
        if runs_ahead(eng, self, plan):
            decode_ahead(eng, self, plan)
            return True
        out = run_step(self, eng.tracer, plan)
        with eng.lock:
            postprocess(eng, self, plan, out)
            eng.changed()
        return True
