"""The serving engine: requests arrive in wall-clock time, wait in the prefill queue (and, when
disaggregated, the decode queue), and the workers step until every request has finished.

    engine = ServingEngine(settings, workers, seqs, arrivals, device)
    spans, records = engine.run()

Each worker's loop is Worker.step (schedule, run, postprocess). One worker runs in the
calling thread; two (disaggregated) take turns in it, or with `threads` each runs in its
own host thread on its own CUDA stream, so their forwards overlap on the GPU (graph
replays and kernel launches release the GIL). Shared state changes only under `lock`; a
forward runs outside it. Every request finishes: KV pressure waits or preempts (recompute),
never drops; a run that can make no progress raises StalledError rather than hang.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import nullcontext

import torch

from kestrel_rt.serve.arrivals import Arrivals
from kestrel_rt.serve.handover import Link
from kestrel_rt.serve.queues import DecodeQueue, PrefillJob
from kestrel_rt.serve.requests import Sequence
from kestrel_rt.serve.settings import ServeSettings
from kestrel_rt.trace import Tracer
from kestrel_sim.trace import RequestRecord, Span

LINK_POLL_S = 0.0005  # idle workers look for landed KV transfers this often (GPU)


class StalledError(RuntimeError):
    """No worker can run, nothing is on its way, and requests are unfinished (a bug)."""


class ServingEngine:
    def __init__(self, settings: ServeSettings, workers: list, seqs: list[Sequence],
                 arrivals: Arrivals, device: torch.device, observer=None,
                 threads: bool = False):
        self.settings = settings
        self.workers = workers  # [colocated] or [prefill, decode]
        self.seqs = seqs
        self.arrivals = arrivals
        self.device = torch.device(device)
        self.observer = observer  # observer(engine, worker, plan) before each step (tests)
        self.threads = threads and len(workers) > 1
        self.prefill_queue: deque[PrefillJob] = deque()
        self.decode_queue = DecodeQueue(settings.decode_order)
        self.ready_at = [0.0] * len(seqs)  # when each entered the decode queue
        self.link = Link("link0", workers[0], workers[1], None) if len(workers) > 1 else None
        self.lock = threading.Condition()
        self.idle: set = set()  # workers that found nothing to run since the last change
        self.done = 0
        self.preemptions = 0
        self.failed: BaseException | None = None
        self.tracer = Tracer(self.device)

    # ------------------------------------------------------------------ the run

    def run(self) -> tuple[list[Span], list[RequestRecord]]:
        self.tracer = Tracer(self.device)  # t = 0: the workload's clock starts now
        if self.link is not None:
            self.link.tracer = self.tracer
        for w in self.workers:
            if w.spec is not None:
                w.spec.tracer = self.tracer
        if self.threads:
            threads = [threading.Thread(target=self.work, args=(w,), name=w.name)
                       for w in self.workers]
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
            moving = self.link is not None and self.link.busy()
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
        landed = self.link.landed() if self.link is not None else []
        for t in landed:
            src = self.link.src
            src.kv.give(t.held)
            src.slots.free(t.src_slot)
            self.emit([t.seq], [1], now)  # the first token reaches the client with the KV
            self.decode_queue.push(t.seq)
            self.ready_at[t.seq.rid] = now
        if self.link is not None:
            self.link.start()  # slots freed since: waiting transfers may go
        if due or landed:
            self.changed()

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

    def describe(self) -> str:
        """The engine's state, for a StalledError."""
        ws = "; ".join(f"{w.name}: {len(w.prefilling)} prefilling, {w.batch_size} running, "
                       f"KV {w.kv.used}/{w.kv.capacity}, {len(w.slots.free_slots)} free slots"
                       for w in self.workers)
        return (f"serving stalled with {self.done}/{len(self.seqs)} requests finished: "
                f"{len(self.prefill_queue)} in the prefill queue, {len(self.decode_queue)} in "
                f"the decode queue; {ws}")


def stream_of(w):
    """The worker's CUDA stream as the current one (nothing on the CPU)."""
    return torch.cuda.stream(w.stream) if w.stream is not None else nullcontext()
