"""A worker: one device running the target (and maybe the draft), with its batch and KV.

Its roles: `colocated` (prefill and decode with continuous batching), `prefill` or
`decode` (disaggregated pools). Steps are in steps.py; the process loops are in
processes.py; the KV hand-over between prefill and decode workers in handover.py.

A disaggregated worker counts its free physical KV slots (slots.py: one cache row per
sequence): a prefill worker holds one per request from admission until its KV has landed in
a decode worker, a decode worker one per request from the start of the transfer into it
until the request finishes or is preempted. A colocated worker's slots never bind (None).
"""

from __future__ import annotations

from kestrel_sim.sim.batch import RunningBatch
from kestrel_sim.sim.kv import KVPool
from kestrel_sim.sim.state import PrefillJob


class Worker:
    __slots__ = (
        "batch", "device", "draft_name", "free_slots", "kv", "last_rows", "last_was_prefill",
        "link", "name", "prefilling", "queue", "role", "slots", "wake",
    )

    def __init__(self, name: str, role: str, kv_capacity: int, draft_name: str | None,
                 slots: int | None = None):
        self.name = name  # span worker name of the target, e.g. "gpu0/target"
        self.role = role  # colocated | prefill | decode
        self.draft_name = draft_name  # span worker name of the draft, or None
        self.kv = KVPool(kv_capacity)
        self.batch = RunningBatch()
        self.prefilling: list[PrefillJob] = []  # admitted, prompt not fully prefilled yet
        self.last_was_prefill = False
        # rows of the last plain decode round, or -1 after any other step (a round of the
        # same rows with nothing waiting runs ahead of the host: kestrel_rt/serve/ahead.py)
        self.last_rows = -1
        self.wake = None  # a simpy event while idle, else None
        self.link = None  # prefill workers (disaggregated): their KV transfer link
        self.device = None  # the SharedDevice it shares with other workers (serving.devices), or None
        self.slots = slots  # physical KV slots (None: not counted, they never bind)
        self.free_slots = slots  # of them, not held by a request
        self.queue = None  # decode workers: the DecodeQueue of requests whose KV landed here
