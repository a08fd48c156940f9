"""The serving engine: requests arrive in wall-clock time, wait in the prefill queue (and, when
disaggregated, a decode queue), and the workers step until every request has finished.

    engine = ServingEngine(settings, workers, seqs, arrivals)
    spans, records = engine.run()

Workers: colocated ones (each takes from the prefill queue and decodes what it prefilled),
or prefill and decode workers in any number (disaggregated): prefill workers take from the
prefill queue and hand each prefilled request's KV over their link (handover.py) to a decode
worker, whose queue it joins when the copy has landed; decode workers take from their queue
(fifo or shortest-first) at round boundaries. Each decode worker has its own queue (the KV
must land in one worker's cache), as in the simulator (kestrel_sim/sim/handover.py).

Each worker's loop is Worker.step (schedule, run, postprocess). One worker runs in the
calling thread; several take turns in it, or with `threads` each runs in its own host
thread on its own CUDA stream of its device, so their forwards overlap (graph replays and
kernel launches release the GIL). Shared state changes only under `lock`; a forward runs
outside it. Every request finishes: KV pressure waits or preempts (recompute), never drops;
a run that can make no progress raises StalledError rather than hang. `switch_interval_s`
sets how long a thread waiting for the GIL waits before the holder is asked to give it up
(Python's default 5 ms; restored after the run): a decode loop whose round has finished can
otherwise wait that long behind the other loop's host work.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from contextlib import contextmanager, nullcontext

import torch

from kestrel_rt.serve.arrivals import Arrivals
from kestrel_rt.serve.handover import Link, start_transfers
from kestrel_rt.serve.queues import DecodeQueue, PrefillJob
from kestrel_rt.serve.requests import Sequence
from kestrel_rt.serve.settings import ServeSettings
from kestrel_rt.serve.tracing import DevicesTracer
from kestrel_sim.trace import RequestRecord, Span

LINK_POLL_S = 0.0005  # idle workers look for landed KV transfers this often (GPU)


class StalledError(RuntimeError):
    """No worker can run, nothing is on its way, and requests are unfinished (a bug)."""


@contextmanager
def switch_interval(seconds: float | None):
    """sys.setswitchinterval(seconds) inside, the previous value after (None: unchanged)."""
    if seconds is None:
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class ServingEngine:
    def __init__(self, settings: ServeSettings, workers: list, seqs: list[Sequence],
                 arrivals: Arrivals, observer=None, threads: bool = False, link_type=Link,
                 progress=None, switch_interval_s: float | None = None):
        self.switch_interval_s = switch_interval_s  # with threads: the GIL's (None: Python's)
        self.progress = progress  # progress(finished, total) as requests finish (the CLI's bar)
        self.settings = settings
        self.workers = workers  # colocated ones, or prefill ones then decode ones
        self.seqs = seqs
        self.arrivals = arrivals
        self.devices = list(dict.fromkeys(w.target.device for w in workers))
        self.observer = observer  # observer(engine, worker, plan) before each step (tests)
        self.threads = threads and len(workers) > 1
        self.prefill_queue: deque[PrefillJob] = deque()
        decoders = [w for w in workers if w.role == "decode"]
        self.decode_queues = {w.name: DecodeQueue(settings.decode_order) for w in decoders}
        self.ready_at = [0.0] * len(seqs)  # when each entered a decode queue
        self.links = [link_type(f"link{i}", w, decoders)
                      for i, w in enumerate(w for w in workers if w.role == "prefill")]
        self.in_transit: dict[int, object] = {}  # request id -> its Transfer on the way
        self.handovers = [0] * len(seqs)  # KV hand-overs landed, per request
        self.sent = 0  # transfers sent, over all links
        self.lock = threading.Condition()
        self.idle: set = set()  # workers that found nothing to run since the last change
        self.done = 0
        self.preemptions = 0
        self.failed: BaseException | None = None
        self.tracer: DevicesTracer | None = None  # made by run(): its clock starts there

    # ------------------------------------------------------------------ the run

    def run(self) -> tuple[list[Span], list[RequestRecord]]:
        self.tracer = DevicesTracer(self.devices)  # t = 0: the workload's clock starts now
        for link in self.links:
            link.tracer = self.tracer
        for w in self.workers:
            if w.spec is not None:
                w.spec.tracer = self.tracer
        if self.threads:
            threads = [threading.Thread(target=self.work, args=(w,), name=w.name)
                       for w in self.workers]
            with switch_interval(self.switch_interval_s):
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            if self.failed is not None:
                raise self.failed
        else:
            one = len(self.workers) == 1
            with stream_of(self.workers[0]) if one else nullcontext():
                while self.done < len(self.seqs):
                    busy = False
                    for w in self.workers:
                        with nullcontext() if one else stream_of(w):
                            busy |= w.step(self)
                    if not busy:
                        self.wait_for_work(self.workers)
        for seq in self.seqs:
            seq.record.output_tokens = sum(seq.record.emit_counts)
        return self.tracer.collect(), [seq.record for seq in self.seqs]

    def work(self, w) -> None:
        """One worker's thread: step until every request finished (or another failed)."""
        try:
            with stream_of(w):
                while self.done < len(self.seqs) and self.failed is None:
                    if not w.step(self):
                        self.wait_for_work([w])
        except BaseException as err:  # noqa: BLE001 (re-raised by run in the main thread)
            with self.lock:
                self.failed = err
                self.lock.notify_all()

    def wait_for_work(self, waiting: list) -> None:
        """Sleep until the next arrival, a landed transfer or a change by another worker."""
        with self.lock:
            if self.done >= len(self.seqs) or self.failed is not None:
                return
            if not all(w in self.idle for w in waiting):
                return  # something changed since they looked
            nxt = self.arrivals.next_time()
            moving = any(link.busy() for link in self.links)
            if nxt is None and not moving and len(self.idle) == len(self.workers):
                raise StalledError(self.describe())
            timeout = None if nxt is None else max(0.0, nxt - self.now())
            if moving:
                timeout = LINK_POLL_S if timeout is None else min(timeout, LINK_POLL_S)
            self.lock.wait(timeout)

    # ------------------------------------------------------------------ shared state

    def now(self) -> float:
        return self.tracer.now()

    def changed(self) -> None:
        """Shared state changed: idle workers look again."""
        self.idle.clear()
        self.lock.notify_all()

    def observe(self, w, plan) -> None:
        if plan is None:
            self.idle.add(w)
            return
        self.idle.discard(w)
        if self.observer is not None:
            self.observer(self, w, plan)

    def poll(self) -> None:
        """Requests sent by now join the prefill queue; landed KV transfers are delivered."""
        now = self.now()
        due = self.arrivals.due(now)
        for rid, sent in due:
            seq = self.seqs[rid]
            seq.record.arrival = sent
            self.prefill_queue.append(PrefillJob(seq))
        landed = [t for link in self.links for t in link.landed()]
        for t in landed:
            self.deliver(t, now)
        start_transfers(self.links)  # slots freed since: waiting transfers may go
        if due or landed:
            self.changed()

    def hand_over(self, w, seq: Sequence, held: int) -> None:
        """Prefill worker w has prefilled seq: its KV goes over w's link."""
        link = next(link for link in self.links if link.src is w)
        self.in_transit[seq.rid] = link.send(seq, held, self.sent)
        self.sent += 1
        start_transfers(self.links)

    def deliver(self, t, now: float) -> None:
        """A landed transfer: the prefill side lets go, the request joins the decode side."""
        t.src.kv.give(t.held)
        t.src.slots.free(t.src_slot)
        if t.done is not None and t.dst.stream is not None:
            t.dst.stream.wait_event(t.done)  # completed already: a guard, at no cost
        del self.in_transit[t.seq.rid]
        self.handovers[t.seq.rid] += 1
        self.emit([t.seq], [1], now)  # the first token reaches the client with the KV
        self.decode_queues[t.dst.name].push(t.seq)
        self.ready_at[t.seq.rid] = now

    def requeue_preempted(self, seq: Sequence) -> None:
        """A preempted request goes to the front of the prefill queue, to be recomputed."""
        seq.record.preemptions += 1
        self.preemptions += 1
        self.prefill_queue.appendleft(PrefillJob(seq))

    def emit(self, seqs: list[Sequence], counts: list[int], now: float) -> None:
        for seq, n in zip(seqs, counts):
            seq.record.emit_times.append(now)
            seq.record.emit_counts.append(n)

    def finish(self, seqs: list[Sequence], now: float) -> None:
        for seq in seqs:
            seq.record.finish = now
            self.arrivals.finished(now)
        self.done += len(seqs)
        if self.progress is not None and seqs:
            self.progress(self.done, len(self.seqs))

    def describe(self) -> str:
        """The engine's state, for a StalledError."""
        queued = sum(len(q) for q in self.decode_queues.values())
        ws = "; ".join(f"{w.name}: {len(w.prefilling)} prefilling, {w.batch_size} running, "
                       f"KV {w.kv.used}/{w.kv.capacity}, {len(w.slots.free_slots)} free slots"
                       for w in self.workers)
        return (f"serving stalled with {self.done}/{len(self.seqs)} requests finished: "
                f"{len(self.prefill_queue)} in the prefill queue, {queued} in the "
                f"decode queues, {len(self.in_transit)} in transit; {ws}")


def stream_of(w):
    """The worker's CUDA stream as the current one (nothing on the CPU)."""
    return torch.cuda.stream(w.stream) if w.stream is not None else nullcontext()
