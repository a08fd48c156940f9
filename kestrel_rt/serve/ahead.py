"""Decode rounds run ahead: while a worker's step is a plain decode round (no draft, no prompt
chunks) and nothing would change the next round's plan, the next round is enqueued from
this round's token ids on the device before the host reads them, as kestrel_rt/engine.py's
overlapped loop does. On a GPU the host's work between rounds (reading the ids,
postprocess, the checks, the next launch) then runs while the device runs the next round,
instead of adding to each step (docs/performance.md: about 0.3 ms a step on the H200).

The next round is the one the scheduler would plan (kestrel_rt/serve/scheduler.py) when:
- every row still runs after the round in flight (at least 2 tokens left before it);
- the worker has nothing to admit or prefill: no prompt being prefilled or joining, its
  queue empty (the prefill queue for a colocated worker, its decode queue for a decode
  worker), no arrival due within one round from now;
- under `preempt`, the KV of both rounds' new tokens fits.
The scheduler's limits hold for it as for a scheduled round: the observer sees it, with
`Worker.in_flight` = 1 (the KV already holds the round in flight's inputs).
"""

from __future__ import annotations

import time

import torch

from kestrel_rt.model import Chosen
from kestrel_rt.serve.forward import StepOutput
from kestrel_rt.serve.postprocess import postprocess


def runs_ahead(eng, w, plan) -> bool:
    """Whether `plan` is a round that may run ahead: plain decode, and no other worker
    waiting for this thread (several workers in one thread take turns a step each)."""
    return (plan.kind == "round" and not plan.chunks and w.spec is None
            and (eng.threads or len(eng.workers) == 1))


def decode_ahead(eng, w, plan) -> None:
    """Run `plan`'s round, and the same round again while steady(), each launched before the
    previous one's ids are read; postprocess each in turn."""
    rows = plan.rows
    tokens = torch.tensor([[seq.tokens[-1]] for seq in rows], dtype=torch.long)  # [b, 1]
    pending = launch(eng, w, rows, tokens, ahead=0)
    read_at = None
    while True:
        with eng.lock:
            eng.poll()
            go = steady(eng, w, rows)
            if go:
                w.in_flight = 1
                eng.observe(w, plan)
        nxt = launch(eng, w, rows, pending.tokens, ahead=1) if go else None
        w.rounds_ahead += go
        ids = pending.read()  # [b, 1] ids on the host, waiting for the round if need be
        now = time.perf_counter()
        if read_at is not None:
            w.round_s = now - read_at
        read_at = now
        with eng.lock:
            w.in_flight = 0
            postprocess(eng, w, plan, StepOutput(ids, []))
            eng.changed()
        if nxt is None:
            return
        pending = nxt


def launch(eng, w, rows, tokens: torch.Tensor, ahead: int) -> Chosen:
    """Enqueue one decode round over `rows` from `tokens` [b, 1] (host, or the previous
    round's ids on the device: a graph's own input, not copied); `ahead` rounds are in
    flight before it (their tokens not yet in the rows' contexts)."""
    context = sum(seq.ctx for seq in rows) + ahead * len(rows)
    with eng.tracer.span("decode", w.name, [seq.rid for seq in rows], tokens=len(rows),
                         context=context):
        return w.target.forward_greedy(tokens, [seq.slot for seq in rows])  # ids [b, 1]


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
