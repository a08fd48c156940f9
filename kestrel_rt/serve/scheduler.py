"""What a worker runs next: admission from its queue, then a round or a prefill step, by the
simulator's rules (kestrel_sim/sim/steps.py admit_prefill, decode_round, prefill_step and
processes.py's worker loops), so a run on hardware and a simulated run are comparable.

- Prefill admission (colocated and prefill workers): FIFO, the head blocks the rest; a job
  is admitted while the prompt tokens not yet prefilled stay under max_batched_tokens, the
  worker holds fewer than max_batch sequences, and its KV charge fits (under `preempt`
  with k + 1 tokens of headroom for every sequence the worker holds, itself included).
- Decode admission (disaggregated decode workers): the head of the worker's decode queue
  (fifo or shortest-first; the requests whose KV landed in its caches) while the batch has
  room and its charge (plus headroom) fits.
- A round: requests prefilled since the last round join the batch; under `preempt` the
  newest are evicted (and queued again at the front, to be recomputed) until every
  sequence's k + 1 new tokens fit, never the last one; in the colocated `mixed` schedule
  the decode (or verify) tokens come first and prompt chunks (FIFO, at most prefill_chunk
  each) get what is left of max_batched_tokens, in the same step.
- `alternate`: while prompts wait, a prefill-only step alternates with a round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kestrel_rt.serve.kv import charge
from kestrel_rt.serve.queues import PrefillJob
from kestrel_rt.serve.requests import Sequence


@dataclass
class Plan:
    """One step of one worker: a round over `rows` (with prompt chunks riding along in a
    mixed step), or a prefill-only step over `chunks` (rows empty)."""

    kind: str  # round | prefill
    rows: list[Sequence] = field(default_factory=list)  # the running batch, join order
    chunks: list[tuple[PrefillJob, int]] = field(default_factory=list)  # (job, tokens)

    @property
    def chunk_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


def schedule(eng, w) -> Plan | None:
    """Admit what fits, then pick the step (None: nothing to run)."""
    s = eng.settings
    if w.role == "decode":
        admit_decode(eng, w)
        return plan_round(eng, w, with_chunks=False) if w.batch_size else None
    admit_prefill(eng, w)
    if w.role == "prefill":
        return plan_prefill(eng, w) if w.prefilling else None
    if s.mixed:
        if w.batch_size:
            return plan_round(eng, w, with_chunks=True)
        return plan_prefill(eng, w) if w.prefilling else None
    if w.prefilling and not (w.last_was_prefill and w.batch_size):
        w.last_was_prefill = True
        return plan_prefill(eng, w)
    if w.batch_size:
        w.last_was_prefill = False
        return plan_round(eng, w, with_chunks=False)
    return None


def admit_prefill(eng, w) -> None:
    s, q = eng.settings, eng.prefill_queue
    pending = sum(j.need - j.done for j in w.prefilling)
    while (q and pending < s.max_tokens and len(w.prefilling) + w.batch_size < s.max_batch
           and w.slots.can_allocate()):  # (a free slot: only binds while KV is in transit)
        job = q[0]
        c = charge(s, job.seq, job.need)
        headroom = (w.batch_size + len(w.prefilling) + 1) * (s.k + 1) if s.preempt else 0
        if not w.kv.fits(c + headroom):
            return
        q.popleft()
        w.kv.take(c)
        job.seq.slot = w.slots.allocate()
        w.prefilling.append(job)
        pending += job.need
        rec = job.seq.record
        if rec.prefill_start is None:
            rec.prefill_start = now = eng.now()
            if now > rec.arrival:
                eng.tracer.add("queue_wait", "queue/prefill", [job.rid], rec.arrival, now)


def admit_decode(eng, w) -> None:
    s, q = eng.settings, eng.decode_queues[w.name]
    while q and w.batch_size < s.max_batch:
        seq = q.peek()
        c = charge(s, seq, seq.ctx)
        headroom = (w.batch_size + 1) * (s.k + 1) if s.preempt else 0
        if not w.kv.fits(c + headroom):
            break
        q.pop()
        w.kv.take(c)
        w.join(seq)
        ready, now = eng.ready_at[seq.rid], eng.now()
        if now > ready:
            eng.tracer.add("queue_wait", "queue/decode", [seq.rid], ready, now)


def merge_joiners(eng, w) -> None:
    """The requests that joined since the last round enter the batch; their decode starts
    now (kestrel_rt/serve/ahead.py merges them the same way for a round it runs ahead)."""
    now = eng.now()
    for seq in w.merge():
        if seq.record.decode_start is None:
            seq.record.decode_start = now


def plan_round(eng, w, with_chunks: bool) -> Plan:
    s = eng.settings
    merge_joiners(eng, w)
    if s.preempt:
        need = len(w.batch) * (s.k + 1)
        while not w.kv.fits(need) and len(w.batch) > 1:
            seq = w.batch.pop()  # the newest
            w.kv.give(seq.ctx)
            need -= s.k + 1
            w.slots.free(seq.slot)
            seq.slot = None
            eng.requeue_preempted(seq)
    chunks = []
    if with_chunks and w.prefilling:
        chunks = take_chunks(s, w, s.max_tokens - len(w.batch) * (s.k + 1))
    return Plan("round", list(w.batch), chunks)


def plan_prefill(eng, w) -> Plan:
    return Plan("prefill", [], take_chunks(eng.settings, w, eng.settings.max_tokens))


def take_chunks(s, w, budget: int) -> list[tuple[PrefillJob, int]]:
    """The next chunks of w.prefilling (FIFO, at most prefill_chunk per prompt) in `budget`."""
    chunks = []
    for job in w.prefilling:
        if budget <= 0:
            break
        n = min(job.need - job.done, s.chunk, budget)
        chunks.append((job, n))
        budget -= n
    return chunks
