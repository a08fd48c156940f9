"""The KV hand-over of disaggregated serving: a prefilled request's KV rows are copied from
the prefill worker's caches into the decode worker's (target and draft), one transfer at a
time in FIFO order (the simulator's link), each a `kv_transfer` span on "link0".

On a GPU the copies run on the link's own stream, after the prefill step that wrote the
rows (an event recorded on the prefill worker's stream), so they overlap both workers'
steps; a transfer has landed when its end event has completed. On the CPU a copy is done
when it returns. Landed transfers are handled by the engine (Engine.poll): the prefill
worker's slot and KV charge are given back, the first token reaches the client, and the
request enters the decode queue.

A transfer needs a free slot in the decode worker's caches; the decode worker has
max_batch spare slots beyond its batch for requests in transit or queued, and when they
are all taken a transfer waits for one (the simulator's decode side has no such limit: a
run that waits here says so in the trace meta, `handover_slot_waits`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from kestrel_rt.kv_cache import KVCache
from kestrel_rt.serve.requests import Sequence


@dataclass
class Transfer:
    seq: Sequence
    held: int  # the prefill worker's KV charge for it, given back when it lands
    src_slot: int
    ready: object = None  # CUDA event: the prefill step that wrote its rows (GPU)
    done: object = None  # CUDA event: the copy finished (GPU); None on the CPU
    waited: bool = False  # found no free decode slot when its turn came


def copy_rows(src: KVCache, src_slot: int, dst: KVCache, dst_slot: int, n: int) -> None:
    """The first n tokens of src_slot into dst_slot (all layers, K and V); dst's length = n."""
    dst.k[:, dst_slot, :n].copy_(src.k[:, src_slot, :n], non_blocking=True)
    dst.v[:, dst_slot, :n].copy_(src.v[:, src_slot, :n], non_blocking=True)
    dst.advance([dst_slot], [n])


class Link:
    def __init__(self, name: str, src, dst, tracer):
        self.name = name
        self.src, self.dst = src, dst  # prefill worker, decode worker
        self.tracer = tracer
        device = src.target.device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.waiting: deque[Transfer] = deque()  # sent, no decode slot free yet
        self.moving: deque[Transfer] = deque()  # copies enqueued, in FIFO order
        self.slot_waits = 0

    def busy(self) -> bool:
        return bool(self.waiting or self.moving)

    def send(self, seq: Sequence, held: int) -> None:
        """Called by the prefill worker (its stream current) when seq's prompt is prefilled."""
        t = Transfer(seq, held, seq.slot)
        if self.cuda:
            t.ready = torch.cuda.Event()
            t.ready.record()
        self.waiting.append(t)
        self.start()

    def start(self) -> None:
        """Enqueue the waiting copies that have a decode slot."""
        while self.waiting:
            if not self.dst.slots.can_allocate():
                if not self.waiting[0].waited:
                    self.waiting[0].waited = True
                    self.slot_waits += 1
                return
            t = self.waiting.popleft()
            dst_slot = self.dst.slots.allocate()
            n = t.seq.ctx - 1  # the KV holds every token but the one just generated
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(t.ready)
                    self._copy(t, dst_slot, n)
                    t.done = torch.cuda.Event()
                    t.done.record()
            else:
                self._copy(t, dst_slot, n)
            t.seq.slot = dst_slot
            self.moving.append(t)

    def _copy(self, t: Transfer, dst_slot: int, n: int) -> None:
        with self.tracer.span("kv_transfer", self.name, [t.seq.rid], tokens=n):
            for src_model, dst_model in zip(self.src.models, self.dst.models):
                copy_rows(src_model.kv, t.src_slot, dst_model.kv, dst_slot, n)

    def landed(self) -> list[Transfer]:
        """Transfers whose copy has finished, in FIFO order."""
        out = []
        while self.moving and (self.moving[0].done is None or self.moving[0].done.query()):
            out.append(self.moving.popleft())
        return out
