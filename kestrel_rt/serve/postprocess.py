"""After a step: append the tokens, emit them, finish requests, and move prefilled ones on,
as the simulator's decode_round (after its timeout) and _complete_chunks do.

A round: every row emits its tokens at once (one, or min(accepted + 1, remaining) in a
speculative round); under `preempt` the KV charge grows by them; finished requests give
back their charge (tokens, or their reservation under `wait`) and their slot. Then the
chunks: a prompt whose last chunk ran gets its first token, which reaches the client now
(colocated) or with its KV at the decode worker (disaggregated: the KV link emits it, unless
that token was the request's only one); it joins the batch, or goes over the link.
"""

from __future__ import annotations

from kestrel_rt.serve.kv import charge, reservation


def postprocess(eng, w, plan, out) -> None:
    now = eng.now()
    if plan.kind == "round":
        finish_round(eng, w, plan.rows, out.rows, now)
    if plan.chunks:
        complete_chunks(eng, w, plan.chunks, out.chunks, now)


def finish_round(eng, w, rows, emitted, now: float) -> None:
    s = eng.settings
    counts = []
    for seq, tokens in zip(rows, emitted):
        tokens = tokens[:seq.rem]  # a speculative round never emits past the output length
        seq.tokens.extend(tokens)
        counts.append(len(tokens))
    if s.preempt:
        w.kv.take(sum(counts))
    eng.emit(rows, counts, now)
    done = [seq for seq in rows if seq.rem == 0]
    if not done:
        return
    w.kv.give(sum(seq.ctx if s.preempt else reservation(s, seq) for seq in done))
    w.batch = [seq for seq in w.batch if seq.rem > 0]
    for seq in done:
        w.slots.free(seq.slot)
        seq.slot = None
    eng.finish(done, now)


def complete_chunks(eng, w, chunks, after: list[int], now: float) -> None:
    s = eng.settings
    completed = []
    for (job, n), token in zip(chunks, after):
        job.done += n
        if job.done == job.need:
            job.seq.tokens.append(token)  # the first token (after a preemption: the next)
            completed.append(job)
    if not completed:
        return
    w.prefilling = [j for j in w.prefilling if j.done < j.need]
    visible = [j.seq for j in completed if w.role != "prefill" or j.seq.rem == 0]
    if visible:
        eng.emit(visible, [1] * len(visible), now)
    finished = []
    for job in completed:
        seq = job.seq
        held = charge(s, seq, job.need)
        if s.preempt:
            w.kv.take(1)
            held += 1
        if seq.rem == 0:
            w.kv.give(held)
            w.slots.free(seq.slot)
            seq.slot = None
            if seq.record.decode_start is None:
                seq.record.decode_start = now
            finished.append(seq)
        elif w.role == "prefill":
            eng.hand_over(w, seq, held)
        else:
            w.join(seq)
    if finished:
        eng.finish(finished, now)
