"""Batch steps: admission to prefill, a (chunked) prefill step, and a decode or speculative
round. Each step is one SimPy timeout; its spans are written with their own times.

A speculative round on a batch of b requests at mean context c:
  k draft steps (draft model, 1 token each; all priced at context c: the k-token drift
  is negligible), one target verify of k+1 positions, and in `separate` mode one
  one-token target correction forward; `fused` takes the correction/bonus token from
  the verify. The draft runs on its own device (GPU colocated with the target, or CPU)
  but the round is sequential: the target waits for the draft tokens. Each request
  emits min(accepted + 1, remaining) tokens once, at the round's end.
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.sim.state import SimState
from kestrel_sim.sim.worker import Worker
from kestrel_sim.trace import Span


class StepConfig:
    """Constants the steps need, resolved once from the Scenario (no pydantic in the loop)."""

    __slots__ = (
        "acceptance", "chunk", "draft", "max_batch", "max_tokens", "preempt", "separate",
        "target",
    )

    def __init__(self, target, draft, acceptance, separate: bool, max_batch: int,
                 max_tokens: int, chunk: int, preempt: bool):
        self.target = target  # StageCost of the target model
        self.draft = draft  # StageCost of the draft model, or None
        self.acceptance = acceptance  # AcceptanceModel, or None
        self.separate = separate
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.chunk = chunk
        self.preempt = preempt  # KV policy: preempt (True) or wait (False)


def charge(st: SimState, rid: int, tokens: int) -> int:
    """KV tokens a request holds on admission: its tokens, or its full reservation."""
    return tokens if st.reserve is None else int(st.reserve[rid])


def admit_prefill(st: SimState, cfg: StepConfig, w: Worker) -> None:
    """Move jobs from the prefill queue into `w.prefilling` while batch, token budget and
    KV allow (FIFO: the head blocks the rest)."""
    q = st.prefill_queue
    if not q:
        return
    slots = st.k + 1
    pending = sum(j.need - j.done for j in w.prefilling)
    while q and pending < cfg.max_tokens and len(w.prefilling) + len(w.batch) < cfg.max_batch:
        job = q[0]
        c = charge(st, job.rid, job.need)
        headroom = (len(w.batch) + len(w.prefilling) + 1) * slots if st.reserve is None else 0
        if not w.kv.fits(c + headroom):
            return
        q.popleft()
        w.kv.used += c
        w.prefilling.append(job)
        pending += job.need
        rec = st.records[job.rid]
        if rec.prefill_start is None:
            rec.prefill_start = st.env.now
            if st.env.now > rec.arrival:
                st.spans.append(Span("queue_wait", "queue/prefill", rec.arrival, st.env.now,
                                     [job.rid]))


def prefill_step(st: SimState, cfg: StepConfig, w: Worker, on_prefilled):
    """One chunked prefill step over `w.prefilling`; completed jobs emit their first
    token (a disaggregated prefill worker's on arrival of the KV at the decode side) and go
    to `on_prefilled(rid, ctx, rem, kv_charge)` (or finish)."""
    env = st.env
    now = env.now
    budget = cfg.max_tokens
    chunks = []
    tokens = ctx_sum = 0
    for job in w.prefilling:
        if budget <= 0:
            break
        n = min(job.need - job.done, cfg.chunk, budget)
        chunks.append((job, n))
        budget -= n
        tokens += n
        ctx_sum += job.done
    nb = len(chunks)
    ids = [job.rid for job, _ in chunks]
    t_target = cfg.target.seconds("prefill", nb, tokens / nb, ctx_sum / nb)
    st.spans.append(Span("prefill", w.name, now, now + t_target, ids, tokens, ctx_sum))
    dur = t_target
    if cfg.draft is not None:
        t_draft = cfg.draft.seconds("prefill", nb, tokens / nb, ctx_sum / nb)
        if t_draft > 0:
            st.spans.append(Span("prefill", w.draft_name, now + dur, now + dur + t_draft, ids,
                                 tokens, ctx_sum))
            dur += t_draft
    yield env.timeout(dur)

    completed = []
    for job, n in chunks:
        job.done += n
        if job.done == job.need:
            completed.append(job)
    if not completed:
        return
    w.prefilling = [j for j in w.prefilling if j.done < j.need]
    # a disaggregated prefill worker's first token reaches the client with the KV, from the
    # decode side (as vLLM, SGLang and Dynamo stream it): on_prefilled emits it on arrival
    now_ids = [j.rid for j in completed if w.role != "prefill" or j.rem == 1]
    if now_ids:
        st.emit(np.array(now_ids, dtype=np.int64), np.ones(len(now_ids), dtype=np.int64))
    finished = []
    for job in completed:
        rem = job.rem - 1
        ctx = job.need + 1
        held = charge(st, job.rid, job.need)
        if st.reserve is None:
            w.kv.used += 1
            held += 1
        if rem == 0:
            w.kv.used -= held
            rec = st.records[job.rid]
            if rec.decode_start is None:
                rec.decode_start = env.now
            finished.append(job.rid)
        else:
            on_prefilled(job.rid, ctx, rem, held)
    if finished:
        st.finish(finished)


def decode_round(st: SimState, cfg: StepConfig, w: Worker):
    """One decode step (no speculation) or one speculative round over `w.batch`."""
    env = st.env
    batch = w.batch
    joined = batch.merge()
    now = env.now
    for rid in joined:
        rec = st.records[rid]
        if rec.decode_start is None:
            rec.decode_start = now
    k = st.k
    if cfg.preempt:
        need = len(batch.ids) * (k + 1)
        while not w.kv.fits(need) and len(batch.ids) > 1:
            rid, ctx, rem = batch.pop_newest()
            w.kv.used -= ctx
            need -= k + 1
            st.requeue_preempted(rid, ctx, rem)
    ids, rem = batch.ids, batch.rem
    b = len(ids)
    csum = batch.ctx_sum
    c = csum / b
    rlist = ids.tolist()
    spans = st.spans
    if k:
        td = cfg.draft.seconds("draft", b, 1, c)
        acc = cfg.acceptance.sample(b, st.rng)
        alist = acc.tolist()
        tv = cfg.target.seconds("verify", b, k + 1, c)
        t = now
        for j in range(k):
            spans.append(Span("draft", w.draft_name, t, t + td, rlist, b, csum + j * b))
            t += td
        spans.append(Span("verify", w.name, t, t + tv, rlist, b * (k + 1), csum, k, alist))
        t += tv
        if cfg.separate:
            asum = sum(alist)
            tc = cfg.target.seconds("correction", b, 1, (csum + asum) / b)
            spans.append(Span("correction", w.name, t, t + tc, rlist, b, csum + asum))
            t += tc
        emit = np.minimum(acc + 1, rem)
        dur = t - now
    else:
        dur = cfg.target.seconds("decode", b, 1, c)
        spans.append(Span("decode", w.name, now, now + dur, rlist, b, csum))
        emit = np.ones(b, dtype=np.int64)
    yield env.timeout(dur)

    total = int(emit.sum())
    batch.grow(emit, total)
    if cfg.preempt:
        w.kv.used += total
    st.emit(ids, emit)
    done = rem == 0
    if done.any():
        fin = ids[done]
        if cfg.preempt:
            w.kv.used -= int(batch.ctx[done].sum())
        else:
            w.kv.used -= int(st.reserve[fin].sum())
        batch.keep(~done)
        st.finish(fin.tolist())
