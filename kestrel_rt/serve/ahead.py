"""Decode rounds run ahead: while a worker's step is a plain decode round (no draft, no prompt
chunks) and the next round's plan does not depend on this round's token ids, the next round
is enqueued from this round's ids on the device before the host reads them, as
kestrel_rt/engine.py's overlapped loop does. On a GPU the host's work between rounds
(reading the ids, postprocess, the checks, the next launch) then runs while the device runs
the next round, instead of adding to each step (docs/performance.md: about 0.3 ms a step on
the H200).

The next round is the one the scheduler would plan (kestrel_rt/serve/scheduler.py) when:
- the worker has nothing to prefill: no prompt being prefilled or joining, and (colocated)
  the prefill queue empty with no arrival due within one round from now;
- under `preempt`, the KV of both rounds' new tokens fits;
- the rows are those of the round in flight, except that (a decode worker) rows that
  finish with it leave and requests from its decode queue join, admitted by the
  scheduler's own rule (scheduler.admit_decode): their inputs are their last tokens from
  the host, the others' this round's ids on the device; under `preempt` only while both
  rounds' new tokens fit (else plan_round could evict). A colocated worker's rows must all
  still run after the round in flight (its joiners come from prompt chunks).
The scheduler's limits hold for it as for a scheduled round: the observer sees it, with
`Worker.in_flight` the requests whose token of the round in flight the KV already holds.
"""

from __future__ import annotations

import time

import torch

from kestrel_rt.model import Chosen
from kestrel_rt.serve.forward import StepOutput
from kestrel_rt.serve.postprocess import postprocess
from kestrel_rt.serve.scheduler import Plan, admit_decode, merge_joiners
from kestrel_rt.spec.round import to_device


def runs_ahead(eng, w, plan) -> bool:
    """Whether `plan` is a round that may run ahead: plain decode, and no other worker
    waiting for this thread (several workers in one thread take turns a step each)."""
    return (plan.kind == "round" and not plan.chunks and w.spec is None
            and (eng.threads or len(eng.workers) == 1))


def decode_ahead(eng, w, plan) -> None:
    """Run `plan`'s round, and the next while next_rows() has one, each launched before the
    previous one's ids are read; postprocess each in turn."""
    tokens = torch.tensor([[seq.tokens[-1]] for seq in plan.rows], dtype=torch.long)  # [b, 1]
    pending = launch(eng, w, plan.rows, tokens, ahead=0)
    read_at = None
    while True:
        nxt_plan = None
        with eng.lock:
            eng.poll()
            rows = next_rows(eng, w, plan.rows)
            if rows is not None:
                nxt_plan = Plan("round", rows)
                w.in_flight = {seq.rid for seq in plan.rows}
                eng.observe(w, nxt_plan)
        nxt = None
        if nxt_plan is not None:
            ahead = sum(seq.rid in w.in_flight for seq in nxt_plan.rows)
            nxt = launch(eng, w, nxt_plan.rows, inputs(plan.rows, pending.tokens, nxt_plan.rows),
                         ahead)
            w.rounds_ahead += 1
        ids = pending.read()  # [b, 1] ids on the host, waiting for the round if need be
        now = time.perf_counter()
        if read_at is not None:
            w.round_s = now - read_at
        read_at = now
        with eng.lock:
            w.in_flight = set()
            postprocess(eng, w, plan, StepOutput(ids, []))
            eng.changed()
        if nxt is None:
            return
        pending, plan = nxt, nxt_plan


def launch(eng, w, rows, tokens: torch.Tensor, ahead: int) -> Chosen:
    """Enqueue one decode round over `rows` from `tokens` [b, 1] (host, or the previous
    round's ids on the device: a graph's own input, not copied); `ahead` of the rows have a
    token in flight (not yet in their contexts)."""
    context = sum(seq.ctx for seq in rows) + ahead
    with eng.tracer.span("decode", w.name, [seq.rid for seq in rows], tokens=len(rows),
                         context=context):
        return w.target.forward_greedy(tokens, [seq.slot for seq in rows])  # ids [b, 1]


def inputs(rows, ids: torch.Tensor, nxt) -> torch.Tensor:
    """The next round's input ids [b', 1]: the ids [b, 1] of the round in flight over `rows`
    for the rows that stay (on the device), then the last tokens of those that joined. What
    the host adds (the kept rows' indices, the joiners' tokens) goes over in one pinned,
    asynchronous copy: a pageable one would wait for the round in flight."""
    if nxt == rows:
        return ids
    at = {seq.rid: i for i, seq in enumerate(rows)}
    kept = [at[seq.rid] for seq in nxt if seq.rid in at]
    joined = [seq.tokens[-1] for seq in nxt[len(kept):]]
    if kept == list(range(len(kept))) and not joined:
        return ids[:len(kept)]  # the first rows stay: a view, no copy
    host = to_device(kept + joined, ids.device)  # [kept + joined]
    return torch.cat([ids[:, 0].index_select(0, host[:len(kept)]), host[len(kept):]])[:, None]


def steady(eng, w, rows) -> bool:
    """Whether the scheduler would plan the same round once the one in flight is done."""
    s = eng.settings
    if any(seq.rem < 2 for seq in rows) or w.prefilling or w.joined:
        return False
    queued = eng.decode_queues[w.name] if w.role == "decode" else eng.prefill_queue
    if queued:
        return False
    nxt = eng.arrivals.next_time()
    if w.role != "decode" and nxt is not None and nxt <= eng.now() + w.round_s:
        return False
    return not s.preempt or w.kv.fits(2 * len(rows) * (s.k + 1))


def next_rows(eng, w, rows) -> list | None:
    """The rows of the round the scheduler would plan after the one in flight over `rows`,
    where it can be known before that round's ids are read (the module docstring), else
    None. Joiners are admitted and merged here, as the scheduler's plan_round does."""
    if steady(eng, w, rows):
        return rows
    if w.role != "decode" or w.prefilling or w.joined:
        return None
    admit_decode(eng, w)  # by the scheduler's rule (the rows that finish still count)
    merge_joiners(eng, w)
    running = {seq.rid for seq in rows}
    stay = [seq for seq in w.batch if seq.rem >= 2 or seq.rid not in running]
    s = eng.settings
    if s.preempt and not w.kv.fits((len(rows) + len(stay)) * (s.k + 1)):
        return None  # plan_round may evict: the scheduler plans it once the ids are read
    return stay or None
