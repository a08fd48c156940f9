"""Batch steps: admission to prefill, a (chunked) prefill step, and a decode or speculative
round. Each step is one SimPy timeout; its spans are written with their own times.

A speculative round on a batch of b requests at mean context c:
  k draft steps (draft model, 1 token each; all priced at context c: the k-token drift
  is negligible), one target verify of k+1 positions, and in `separate` mode one
  one-token target correction forward; `fused` takes the correction/bonus token from
  the verify. The draft runs on its own device (GPU colocated with the target, or CPU)
  but the round is sequential: the target waits for the draft tokens. Each request
  emits min(accepted + 1, remaining) tokens once, at the round's end; its verify span
  records the accepted tokens it kept (emitted - 1), and a separate correction is priced
  at the context they leave.

A mixed step (colocated, `prefill_schedule: mixed`, as vLLM's chunked prefill): the
round's decode tokens (b, or b*(k+1) for the verify) are scheduled first and the rest
of max_batched_tokens goes to prefill chunks (FIFO, at most prefill_chunk per prompt;
none when the decode tokens fill the budget), all in the target's decode or verify
forward, priced by `mixed_seconds`. The trace shows that forward as two spans with the
same worker, start and end: the decode/verify span and a prefill span of the chunk.
Chunks that complete emit their first token at the round's end, with the decode tokens.

On a device shared by several workers (serving.devices) a step is a job of the
device (device.py): its time alone and its Shares (the parts' shares, blended by their
times), stretched while other workers' steps overlap it; its spans are kept aside and
written in the times it ran once it ends. A speculative round is one job, or two where the
contention has a law of the draft's own (Contention.drafts_apart: a profile with overlap
rows of draft steps): its k draft steps (side draft, weighed as one step's time), then
the rest of the round.
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.costs.base import IDLE, Chunk, Shares, blend
from kestrel_sim.sim.device import occupy
from kestrel_sim.sim.state import SimState
from kestrel_sim.sim.worker import Worker
from kestrel_sim.trace import Span


class StepConfig:
    """Constants the steps need, resolved once from the Scenario (no pydantic in the loop)."""

    __slots__ = (
        "acceptance", "catch_up", "chunk", "decode_overhead", "draft", "draft_on_device",
        "max_batch", "max_tokens", "mixed", "preempt", "round_overhead", "separate", "target",
    )

    def __init__(self, target, draft, acceptance, separate: bool, max_batch: int,
                 max_tokens: int, chunk: int, preempt: bool, mixed: bool = False,
                 draft_on_device: bool = True, round_overhead=None, catch_up: bool = True,
                 decode_overhead=None):
        self.target = target  # StageCost of the target model
        self.draft = draft  # StageCost of the draft model, or None
        self.acceptance = acceptance  # RequestAcceptance, or None
        self.separate = separate
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.chunk = chunk
        self.preempt = preempt  # KV policy: preempt (True) or wait (False)
        self.mixed = mixed  # colocated: prefill chunks ride in decode/verify forwards
        self.draft_on_device = draft_on_device  # the draft runs on the target's GPU
        # the host's time per speculative round beyond its stages (RoundOverhead), or None
        self.round_overhead = round_overhead
        # a lagging draft's first step is priced at M = 2 (not with a cost table: its ms per
        # draft step holds whatever the step feeds)
        self.catch_up = catch_up
        # the host's time per plain decode round it cannot launch ahead, or None
        self.decode_overhead = decode_overhead

    def draft_shares(self, stage: str, b: int, m: float, c: float) -> Shares:
        """The draft's Shares of the target's device (none when it runs on the CPU)."""
        return self.draft.shares(stage, b, m, c) if self.draft_on_device else IDLE


def charge(st: SimState, rid: int, tokens: int) -> int:
    """KV tokens a request holds on admission: its tokens, or its full reservation."""
    return tokens if st.reserve is None else int(st.reserve[rid])


def admit_prefill(st: SimState, cfg: StepConfig, w: Worker) -> None:
    """Move jobs from the prefill queue into `w.prefilling` while batch, token budget, KV
    and (a disaggregated prefill worker) a free physical slot allow (FIFO: the head blocks
    the rest). The slot is held until the request's KV has landed in a decode worker."""
    q = st.prefill_queue
    if not q:
        return
    per_seq = st.k + 1  # tokens of headroom per sequence held (preempt policy)
    pending = sum(j.need - j.done for j in w.prefilling)
    room = cfg.max_batch - len(w.prefilling) - len(w.batch)
    if w.free_slots is not None:
        room = min(room, w.free_slots)
    while q and pending < cfg.max_tokens and room > 0:
        job = q[0]
        c = charge(st, job.rid, job.need)
        headroom = (len(w.batch) + len(w.prefilling) + 1) * per_seq if st.reserve is None else 0
        if not w.kv.fits(c + headroom):
            return
        q.popleft()
        w.kv.used += c
        w.prefilling.append(job)
        pending += job.need
        room -= 1
        if w.free_slots is not None:
            w.free_slots -= 1
        now = st.env.now
        if st.rec.start_prefill(job.rid, now):
            arrival = float(st.rec.arrival[job.rid])
            if now > arrival:
                st.spans.append(Span("queue_wait", "queue/prefill", arrival, now, [job.rid]))


def _take_chunks(cfg: StepConfig, w: Worker, budget: int):
    """The next chunks of `w.prefilling` (FIFO, at most cfg.chunk tokens per prompt) within
    `budget` tokens: ([(job, tokens)], tokens, context tokens already prefilled)."""
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
    return chunks, tokens, ctx_sum


def _draft_prefill(spans: list, cfg: StepConfig, w: Worker, t: float, ids: list[int],
                   tokens: int, ctx_sum: int) -> float:
    """The draft's own pass over a prefill chunk, from time t on its device; its seconds."""
    if cfg.draft is None:
        return 0.0
    nb = len(ids)
    dur = cfg.draft.seconds("prefill", nb, tokens / nb, ctx_sum / nb)
    if dur > 0:
        spans.append(Span("prefill", w.draft_name, t, t + dur, ids, tokens, ctx_sum))
    return dur


def _prefill_shares(cfg: StepConfig, tf: float, td: float, nb: int, tokens: int,
                    ctx_sum: int) -> Shares:
    """A prefill step's Shares: the target's pass (tf s), then the draft's (td s)."""
    m, c = tokens / nb, ctx_sum / nb
    parts = [(tf, cfg.target.shares("prefill", nb, m, c))]
    if td:
        parts.append((td, cfg.draft_shares("prefill", nb, m, c)))
    return blend(parts)


def prefill_step(st: SimState, cfg: StepConfig, w: Worker, on_prefilled):
    """One chunked prefill step over `w.prefilling`; completed jobs emit their first
    token (a disaggregated prefill worker's on arrival of the KV at the decode side) and go
    to `on_prefilled(rid, ctx, rem, kv_charge)` (or finish)."""
    w.last_rows = -1  # the next decode round follows another step: not launched ahead
    env = st.env
    now = env.now
    chunks, tokens, ctx_sum = _take_chunks(cfg, w, cfg.max_tokens)
    nb = len(chunks)
    ids = [job.rid for job, _ in chunks]
    spans = st.spans if w.device is None else []
    dur = cfg.target.seconds("prefill", nb, tokens / nb, ctx_sum / nb)
    spans.append(Span("prefill", w.name, now, now + dur, ids, tokens, ctx_sum))
    td = _draft_prefill(spans, cfg, w, now + dur, ids, tokens, ctx_sum)
    if w.device is None:
        yield env.timeout(dur + td)
    else:
        shares = _prefill_shares(cfg, dur, td, nb, tokens, ctx_sum)
        yield from occupy(st, w, dur + td, shares, "prefill", spans)
    _complete_chunks(st, w, chunks, on_prefilled)


def _complete_chunks(st: SimState, w: Worker, chunks, on_prefilled) -> None:
    """Advance the chunks' jobs; fully prefilled ones emit their first token and go on."""
    env = st.env
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
            if w.free_slots is not None:  # a prefill worker's slot, no hand-over
                w.free_slots += 1
            st.rec.start_decode(job.rid, env.now)
            finished.append(job.rid)
        else:
            on_prefilled(job.rid, ctx, rem, held)
    if finished:
        st.finish(finished)


def round_host(st: SimState, cfg: StepConfig, w: Worker, b: int, k: int, changed: bool
               ) -> float:
    """The serving loop's own time in a round (seconds; no stage runs in it): a speculative
    round's overhead; a plain decode round's where it cannot have been launched ahead of the
    host, as kestrel_rt/serve/ahead.py launches them: a colocated worker's round of the same
    rows as the last when nothing waits to join (`changed`: rows joined, or a prompt chunk
    rides in it); a decode worker's every round after its first since it was idle, across
    joins and leaves (under preempt, while both rounds' tokens fit)."""
    if k:
        return cfg.round_overhead.seconds(b) if cfg.round_overhead is not None else 0.0
    if w.role == "decode":  # on from its last round, across joins and leaves
        steady = w.last_rows > 0 and (not cfg.preempt or w.kv.fits(2 * b))
    else:
        steady = (not changed and w.last_rows == b and not w.prefilling
                  and not st.prefill_queue)
    w.last_rows = b
    if steady or cfg.decode_overhead is None:
        return 0.0
    return cfg.decode_overhead.seconds(b)


def decode_round(st: SimState, cfg: StepConfig, w: Worker, on_prefilled=None):
    """One decode step (no speculation) or one speculative round over `w.batch`. With
    `on_prefilled` (colocated, mixed schedule) the target's decode or verify forward also
    carries a prefill chunk of `w.prefilling` in what its decode tokens leave of the token
    budget: both get spans of the same start and end on the target (one forward), and the
    draft's own pass over the chunk follows the round's target forwards."""
    env = st.env
    batch = w.batch
    joined = batch.merge()
    now = env.now
    for rid in joined:
        st.rec.start_decode(rid, now)
    k = st.k
    if cfg.preempt:
        need = len(batch.ids) * (k + 1)
        while not w.kv.fits(need) and len(batch.ids) > 1:
            rid, ctx, rem = batch.pop_newest()
            w.kv.used -= ctx
            need -= k + 1
            st.requeue_preempted(rid, ctx, rem)
            if w.free_slots is not None:  # a decode worker: its slot goes (handover.py)
                st.handover.release(w, 1)
    ids, rem = batch.ids, batch.rem
    b = len(ids)
    csum = batch.ctx_sum
    c = csum / b
    rlist = ids.tolist()
    spans = st.spans if w.device is None else []
    chunks = chunk = None
    if on_prefilled is not None and w.prefilling:
        chunks, ptok, pctx = _take_chunks(cfg, w, cfg.max_tokens - b * (k + 1))
        if chunks:
            pids = [job.rid for job, _ in chunks]
            chunk = Chunk(len(chunks), ptok / len(chunks), pctx / len(chunks))
    if k:  # (acceptance: each request's own stream, whatever the order of the steps)
        td = cfg.draft.seconds("draft", b, 1, c)
        # the first step feeds two tokens per sequence where a draft lags (a graph of M = 2)
        lagging = int(batch.lag.sum()) if cfg.catch_up else 0
        td1 = cfg.draft.seconds("draft", b, 2, c) if lagging else td
        acc = batch.accepted(cfg.acceptance)  # [b] each request's own stream
        emit = np.minimum(acc + 1, rem)  # a request near its end keeps fewer than accepted
        alist = (emit - 1).tolist()  # draft tokens accepted and kept
        batch.lag = acc >= k  # all k accepted: the draft never ran d_k
    stage = "verify" if k else "decode"
    if chunk is None:
        tf = cfg.target.seconds(stage, b, k + 1, c)
    else:
        tf = cfg.target.mixed_seconds(stage, b, k + 1, c, chunk)
    if k:
        t = now
        for j in range(k):  # the first step also feeds what lagging drafts did not see
            step, fed = (td1, b + lagging) if j == 0 else (td, b)
            spans.append(Span("draft", w.draft_name, t, t + step, rlist, fed, csum + j * b))
            t += step
        spans.append(Span("verify", w.name, t, t + tf, rlist, b * (k + 1), csum, k, alist))
    else:
        t = now
        spans.append(Span("decode", w.name, t, t + tf, rlist, b, csum))
        emit = np.ones(b, dtype=np.int64)
    if chunk is not None:
        spans.append(Span("prefill", w.name, t, t + tf, pids, ptok, pctx))
    t += tf
    tc = td_prefill = 0.0
    if k and cfg.separate:
        asum = sum(alist)
        tc = cfg.target.seconds("correction", b, 1, (csum + asum) / b)
        spans.append(Span("correction", w.name, t, t + tc, rlist, b, csum + asum))
        t += tc
    if chunk is not None:
        td_prefill = _draft_prefill(spans, cfg, w, t, pids, ptok, pctx)
        t += td_prefill
    host = round_host(st, cfg, w, b, k, bool(joined) or chunk is not None)
    t += host  # the loop's own time before the next round: no stage runs (no span)
    alone = t - now if k or host else tf  # a plain round without host time: tf keeps the bits
    if w.device is None:
        yield env.timeout(alone)
    else:
        drafts = (k - 1) * td + td1 if k else 0.0
        # the draft's steps a job of their own where the contention has a law for them
        apart = bool(k) and cfg.draft_on_device and w.device.contention.drafts_apart
        parts = [(tf, cfg.target.shares(stage, b, k + 1, c, chunk))]
        if k and not apart:
            parts.append((drafts, cfg.draft_shares("draft", b, 1, c)))
        if host:
            parts.append((host, IDLE))
        if tc:
            parts.append((tc, cfg.target.shares("correction", b, 1, (csum + asum) / b)))
        if td_prefill:
            parts.append((td_prefill, cfg.draft_shares("prefill", chunk.batch, chunk.m,
                                                       chunk.context)))
        if apart:  # the k draft spans first, then the rest from when the drafts ended
            yield from occupy(st, w, drafts, cfg.draft_shares("draft", b, 1, c), "draft",
                              spans[:k], td)
            late = env.now - (now + drafts)
            for span in spans[k:]:
                span.start += late
                span.end += late
            yield from occupy(st, w, alone - drafts, blend(parts), "decode", spans[k:])
        else:
            yield from occupy(st, w, alone, blend(parts), "decode", spans)

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
        finished = fin.tolist()
        if k:
            cfg.acceptance.finish(finished)  # their acceptance streams go
        if w.free_slots is not None:  # a decode worker: their slots go (handover.py)
            st.handover.release(w, len(finished))
        st.finish(finished)
    if chunks:
        _complete_chunks(st, w, chunks, on_prefilled)
