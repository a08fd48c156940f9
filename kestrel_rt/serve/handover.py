"""The KV hand-over of disaggregated serving: a prefilled request's KV rows are copied from
its prefill worker's caches into a decode worker's (target and draft), each copy a
`kv_transfer` span on the prefill worker's link.

Each prefill worker has its link ("link0", "link1", ... as the simulator's): its transfers
go one at a time in FIFO order. A transfer needs a free slot in a decode worker's caches and
goes to the decode worker with the most free slots when its copy starts (the others are held
by that worker's batch, its queue and the transfers on their way to it; ties: one on the
prefill worker's device, then the lowest index). Each decode worker has up to max_batch spare
slots beyond its batch for requests in transit or queued (as many as the device's memory
holds: kestrel_sim/sim/slots.py); when no decode worker has one, transfers wait, the oldest
first across the links, and the prefill worker's slots stay held meanwhile. The simulator
models the same slots (kestrel_sim/sim/handover.py): a run that waits says so in the trace
meta, `handover_slot_waits`, on either side.

On a GPU the copies run on the link's own stream on the prefill worker's device, after the
prefill step that wrote the rows (an event recorded on the prefill worker's stream), so
they overlap both workers' steps. Within one device a copy is between two caches; between
two devices it is a peer copy (torch enables peer access and copies over NVLink or PCIe),
with the destination device's current stream set to the link's receive stream there, so it
waits on nothing of the decode worker's. The span is two CUDA events on the link's stream
around the copy; a transfer has landed when its end event has completed. On the CPU a copy
is done when it returns. Landed transfers are handled by the engine (Engine.poll): the
prefill worker's slot and KV charge are given back, the decode worker's stream waits on the
copy's end event, the first token reaches the client, and the request enters that decode
worker's queue. Nothing is read before it lands.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kestrel_rt.kv_cache import KVCache
from kestrel_rt.serve.requests import Sequence


@dataclass
class Transfer:
    seq: Sequence
    src: object  # the prefill worker it comes from
    held: int  # the prefill worker's KV charge for it, given back when it lands
    src_slot: int
    order: int  # when it was sent, over all links (the oldest waiting starts first)
    dst: object = None  # the decode worker it goes to, chosen when its copy starts
    dst_slot: int | None = None
    ready: object = None  # CUDA event: the prefill step that wrote its rows (GPU)
    done: object = None  # CUDA event: the copy finished (GPU); None on the CPU
    waited: bool = False  # found no free decode slot when its turn came


def copy_rows(src: KVCache, src_slot: int, dst: KVCache, dst_slot: int, n: int) -> None:
    """The first n tokens of src_slot into dst_slot (all layers, K and V); dst's length = n.
    The caches may be on two devices (a peer copy)."""
    dst.k[:, dst_slot, :n].copy_(src.k[:, src_slot, :n], non_blocking=True)  # [layers, n, h, d]
    dst.v[:, dst_slot, :n].copy_(src.v[:, src_slot, :n], non_blocking=True)
    dst.advance([dst_slot], [n])


class Link:
    def __init__(self, name: str, src, dsts: list, tracer=None):
        self.name = name
        self.src = src  # the prefill worker
        self.dsts = dsts  # the decode workers
        self.tracer = tracer
        device = src.target.device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.receive: dict[int, torch.cuda.Stream] = {}  # other GPU's index -> a stream there
        self.waiting: deque[Transfer] = deque()  # sent, no decode slot free yet
        self.moving: deque[Transfer] = deque()  # copies enqueued, in FIFO order
        self.slot_waits = 0

    def busy(self) -> bool:
        return bool(self.waiting or self.moving)

    def send(self, seq: Sequence, held: int, order: int) -> Transfer:
        """Called by the prefill worker (its stream current) when seq's prompt is prefilled;
        the copy starts with start_transfers."""
        t = Transfer(seq, self.src, held, seq.slot, order)
        if self.cuda:
            t.ready = torch.cuda.Event()
            t.ready.record()
        self.waiting.append(t)
        return t

    def destination(self):
        """The decode worker the next copy goes to (most free slots; ties: one on this
        link's device, then the lowest index), or None."""
        here = self.src.target.device
        free = [d for d in self.dsts if d.slots.can_allocate()]
        return max(free, key=lambda d: (len(d.slots.free_slots), d.target.device == here),
                   default=None)

    def start_next(self) -> bool:
        """Enqueue the copy of the oldest waiting transfer; False when no slot is free."""
        t = self.waiting[0]
        dst = self.destination()
        if dst is None:
            if not t.waited:
                t.waited = True
                self.slot_waits += 1
            return False
        self.waiting.popleft()
        t.dst, t.dst_slot = dst, dst.slots.allocate()
        self.enqueue(t, t.seq.ctx - 1)  # the KV holds every token but the one just generated
        t.seq.slot = t.dst_slot
        self.moving.append(t)
        return True

    def enqueue(self, t: Transfer, n: int) -> None:
        if not self.cuda:
            self.copy(t, n)
            return
        with self.receive_stream(t.dst), torch.cuda.stream(self.stream):
            self.stream.wait_event(t.ready)
            self.copy(t, n)
            t.done = torch.cuda.Event()
            t.done.record()

    def copy(self, t: Transfer, n: int) -> None:
        with self.tracer.span("kv_transfer", self.name, [t.seq.rid], tokens=n):
            for src_model, dst_model in zip(self.src.models, t.dst.models):
                copy_rows(src_model.kv, t.src_slot, dst_model.kv, t.dst_slot, n)

    def receive_stream(self, dst):
        """The link's stream on dst's GPU as that device's current one (another GPU), else
        nothing: a copy between devices synchronizes with the destination's current stream."""
        device = dst.target.device
        if device.type != "cuda" or device.index == self.stream.device.index:
            return nullcontext()
        if device.index not in self.receive:
            self.receive[device.index] = torch.cuda.Stream(device)
        return torch.cuda.stream(self.receive[device.index])

    def has_landed(self, t: Transfer) -> bool:
        return t.done is None or t.done.query()

    def landed(self) -> list[Transfer]:
        """Transfers whose copy has finished, in FIFO order."""
        out = []
        while self.moving and self.has_landed(self.moving[0]):
            out.append(self.moving.popleft())
        return out


def start_transfers(links: list[Link]) -> None:
    """Start waiting copies, the oldest first over all links, while a decode slot is free
    (every link sees the same decode workers: when the oldest waits, all do)."""
    while True:
        heads = [link for link in links if link.waiting]
        if not heads:
            return
        if not min(heads, key=lambda link: link.waiting[0].order).start_next():
            return
