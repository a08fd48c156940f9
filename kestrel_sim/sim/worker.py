"""A worker: one device running the target (and maybe the draft), with its batch and KV.

Its roles: `colocated` (prefill and decode with continuous batching), `prefill` or
`decode` (disaggregated pools). Steps are in steps.py; the process loops are in
processes.py.
"""

from __future__ import annotations

from kestrel_sim.sim.batch import RunningBatch
from kestrel_sim.sim.kv import KVPool
from kestrel_sim.sim.state import PrefillJob


class Worker:
    __slots__ = (
        "batch", "device", "draft_name", "kv", "last_rows", "last_was_prefill", "link", "name",
        "prefilling", "role", "wake",
    )

    def __init__(self, name: str, role: str, kv_capacity: int, draft_name: str | None):
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
