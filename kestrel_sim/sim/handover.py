"""The KV hand-over of disaggregated serving, as the runtime's (kestrel_rt/serve/handover.py):
a prefilled request's KV goes over its prefill worker's link into a decode worker's caches.

Each prefill worker has its link ("link0", "link1", ...): FIFO, one transfer at a time, the
prompt's KV (target and draft) priced per token. A transfer starts only when a decode worker
has a free physical slot (slots.py; the others are held by its batch, its queue and the
transfers on their way to it) and goes to the one with the most free slots (ties: one on the
prefill worker's device, then the lowest index), which holds that slot until the request
finishes or is preempted. When no decode worker has one, transfers wait, the oldest first
across the links; each transfer that had to wait counts once in `slot_waits` (the trace
meta's `handover_slot_waits`, as the runtime's). When a transfer lands, its prefill worker
gives back the request's slot and KV charge, the first token reaches the client (so TTFT
includes the transfer and any wait for a decode slot) and the request joins its decode
worker's queue.
"""

from __future__ import annotations

from collections import deque
from functools import partial

import numpy as np

from kestrel_sim.hardware import LinkSpec
from kestrel_sim.sim.state import SimState, wake_one
from kestrel_sim.trace import Span

_ONE = np.ones(1, dtype=np.int64)


class LinkState:
    """A KV transfer link: FIFO, one transfer at a time."""

    __slots__ = ("bytes_per_token", "free_at", "name", "spec")

    def __init__(self, name: str, spec: LinkSpec, bytes_per_token: float):
        self.name = name
        self.spec = spec
        self.bytes_per_token = bytes_per_token
        self.free_at = 0.0


class Transfer:
    """A prefilled request on its way: from prefill worker `src`, holding `held` KV there."""

    __slots__ = ("ctx", "held", "rem", "rid", "src", "waited")

    def __init__(self, src, rid: int, ctx: int, rem: int, held: int):
        self.src = src
        self.rid = rid
        self.ctx = ctx  # tokens in the sequence (the prompt and its first token)
        self.rem = rem  # output tokens still to emit
        self.held = held
        self.waited = False  # found no free decode slot when its turn came


class Handover:
    __slots__ = ("decoders", "slot_waits", "st", "waiting")

    def __init__(self, st: SimState, decoders: list):
        self.st = st
        self.decoders = decoders  # the decode workers, in index order
        self.waiting: deque[Transfer] = deque()  # sent, no decode slot free yet (oldest first)
        self.slot_waits = 0

    def send(self, src, rid: int, ctx: int, rem: int, held: int) -> None:
        """Prefill worker `src` has prefilled `rid`: its KV goes when a decode slot is free."""
        self.waiting.append(Transfer(src, rid, ctx, rem, held))
        self.start()

    def release(self, w, n: int) -> None:
        """Decode worker `w` let `n` slots go (requests finished or preempted)."""
        w.free_slots += n
        if self.waiting:
            self.start()

    def destination(self, src):
        """The decode worker with the most free slots (ties: on src's device, then the lowest
        index), or None."""
        best, key = None, None
        for d in self.decoders:
            if d.free_slots:
                k = (d.free_slots, d.device is not None and d.device is src.device)
                if best is None or k > key:
                    best, key = d, k
        return best

    def start(self) -> None:
        """Start waiting transfers, the oldest first, while a decode slot is free."""
        env, waiting = self.st.env, self.waiting
        while waiting:
            t = waiting[0]
            dst = self.destination(t.src)
            if dst is None:
                if not t.waited:
                    t.waited = True
                    self.slot_waits += 1
                return
            waiting.popleft()
            dst.free_slots -= 1
            link: LinkState = t.src.link
            prefilled = t.ctx - 1  # the KV that exists: the prompt's (not the first token's)
            start = max(env.now, link.free_at)
            end = start + link.spec.seconds(prefilled * link.bytes_per_token)
            link.free_at = end
            self.st.spans.append(Span("kv_transfer", link.name, start, end, [t.rid], prefilled))
            env.timeout(end - env.now).callbacks.append(partial(self.landed, t, dst))

    def landed(self, t: Transfer, dst, _ev) -> None:
        st, src = self.st, t.src
        src.kv.used -= t.held
        src.free_slots += 1
        st.emit(np.array([t.rid], dtype=np.int64), _ONE)  # the first token, with the KV
        dst.queue.push(t.rid, t.ctx, t.rem)
        st.ready_at[t.rid] = st.env.now
        if dst.wake is not None:
            wake_one([dst])
        if src.wake is not None and st.prefill_queue:
            wake_one([src])
