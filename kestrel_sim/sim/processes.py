"""SimPy processes: arrivals, colocated workers, prefill workers, decode workers, KV links.

Colocated worker, `mixed` schedule (the default, as vLLM): each decode/speculative round
carries prefill chunks of the waiting prompts in its target forward; with nothing to
decode it runs prefill-only steps. `alternate` schedule: while prompts wait and the batch
has room, one chunked prefill step alternates with one round (so a long prompt stalls
decoding by at most one step); otherwise it runs rounds. Idle, it sleeps until woken.
Disaggregated, as the runtime: prefill workers only prefill, each admitted request holding
one of the worker's physical KV slots (slots.py) until its KV has landed in a decode worker;
the KV goes over the prefill worker's link (FIFO, one transfer at a time: the prompt's KV,
priced per token) once a decode worker has a free slot, which the request then holds until
it finishes or is preempted (handover.py; transfers wait for a slot, the oldest first). The
first token reaches the client with the KV, so TTFT includes the transfer and its wait;
each decode worker pulls from its own queue (the requests whose KV landed in it, fifo or
shortest-first: decode_queue.py) into its batch at round boundaries.
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.sim.state import SimState
from kestrel_sim.sim.steps import StepConfig, admit_prefill, charge, decode_round, prefill_step
from kestrel_sim.sim.worker import Worker
from kestrel_sim.trace import Span


def open_arrivals(st: SimState, times: np.ndarray):
    env = st.env
    for rid, t in enumerate(times.tolist()):
        if t > env.now:
            yield env.timeout(t - env.now)
        st.arrive(rid)


def closed_loop(st: SimState, concurrency: int, think_s: float) -> None:
    """`concurrency` clients; each finish sends the next request after `think_s`."""
    n = st.n
    state = {"next": min(concurrency, n)}

    def on_finish(_rid: int) -> None:
        rid = state["next"]
        if rid >= n:
            return
        state["next"] += 1
        if think_s > 0:
            st.env.timeout(think_s).callbacks.append(lambda _ev: st.arrive(rid))
        else:
            st.arrive(rid)

    st.on_finish = on_finish
    for rid in range(state["next"]):
        st.arrive(rid)


def _sleep(st: SimState, w: Worker):
    w.wake = st.env.event()
    return w.wake


def colocated_worker(st: SimState, cfg: StepConfig, w: Worker):
    join = w.batch.join

    def on_prefilled(rid: int, ctx: int, rem: int, _held: int) -> None:
        join(rid, ctx, rem)

    while True:
        admit_prefill(st, cfg, w)
        if cfg.mixed:
            if len(w.batch):
                yield from decode_round(st, cfg, w, on_prefilled)
            elif w.prefilling:
                yield from prefill_step(st, cfg, w, on_prefilled)
            else:
                yield _sleep(st, w)
        elif w.prefilling and not (w.last_was_prefill and len(w.batch)):
            w.last_was_prefill = True
            yield from prefill_step(st, cfg, w, on_prefilled)
        elif len(w.batch):
            w.last_was_prefill = False
            yield from decode_round(st, cfg, w)
        else:
            yield _sleep(st, w)


def prefill_worker(st: SimState, cfg: StepConfig, w: Worker):
    send = st.handover.send

    def on_prefilled(rid: int, ctx: int, rem: int, held: int) -> None:
        send(w, rid, ctx, rem, held)  # over w's link once a decode slot is free

    while True:
        admit_prefill(st, cfg, w)
        if w.prefilling:
            yield from prefill_step(st, cfg, w, on_prefilled)
        else:
            yield _sleep(st, w)


def decode_worker(st: SimState, cfg: StepConfig, w: Worker):
    env = st.env
    q = w.queue
    per_seq = st.k + 1  # tokens of headroom per sequence held (preempt policy)
    while True:
        while len(q) and len(w.batch) < cfg.max_batch:
            rid, ctx, rem = q.head()
            c = charge(st, rid, ctx)
            headroom = (len(w.batch) + 1) * per_seq if st.reserve is None else 0
            if not w.kv.fits(c + headroom):
                break
            q.pop()
            w.kv.used += c
            w.batch.join(rid, ctx, rem)
            ready = float(st.ready_at[rid])
            if env.now > ready:
                st.spans.append(Span("queue_wait", "queue/decode", ready, env.now, [rid]))
        if len(w.batch):
            yield from decode_round(st, cfg, w)
        else:
            w.last_rows = -1  # its next round starts from the host, not launched ahead
            yield _sleep(st, w)
