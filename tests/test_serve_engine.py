"""The serving engine on a tiny model (CPU, fp32): every request finishes with exactly its
drawn output length, the scheduler's limits hold at every step (checked by an observer, as
the simulator's rules state them), and the generated tokens equal plain greedy generation
of each prompt, through chunked prefill, preemption with recompute and the disaggregated KV
hand-over alike."""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kestrel_rt.engine import generate
from kestrel_rt.serve import serve
from kestrel_rt.serve.kv import reservation
from kestrel_rt.serve.models import build_model
from kestrel_sim.errors import KestrelError
from kestrel_sim.scenario import Scenario


@pytest.fixture(scope="module")
def reference(folder):
    return build_model(str(folder), "cpu")


def scenario(folder, serving: dict, requests=10, prompt=(4, 40), output=(1, 16), seed=0,
             arrivals=None, k=0) -> Scenario:
    """A tiny-model scenario; k > 0 speculates with the target's own folder as the draft
    (organic greedy acceptance: the output stays plain greedy generation's)."""
    spec = {} if not k else {
        "draft": {"model": str(folder), "device": "cpu"},
        "spec": {"k": k, "correction": "fused", "acceptance": {"alpha": 0.5}}}
    return Scenario.load_from_dict({
        "name": "tiny", "hardware": "cpu-xeon", "model": str(folder), "serving": serving, **spec,
        "workload": {
            "arrivals": arrivals or {"process": "poisson", "rate": 400},
            "requests": requests,
            "prompt_tokens": {"dist": "uniform", "low": prompt[0], "high": prompt[1]},
            "output_tokens": {"dist": "uniform", "low": output[0], "high": output[1]},
            "seed": seed,
        },
    })


class Limits:
    """Observer: the simulator's rules, asserted before every step of every worker."""

    def __init__(self):
        self.steps = 0
        self.kinds: set[str] = set()

    def __call__(self, eng, w, plan):
        s = eng.settings
        self.steps += 1
        self.kinds.add(f"{w.role}:{plan.kind}{'+chunks' if plan.rows and plan.chunks else ''}")
        assert len(w.prefilling) + w.batch_size <= s.max_batch
        assert all(1 <= n <= s.chunk for _, n in plan.chunks)
        assert len({id(job) for job, _ in plan.chunks}) == len(plan.chunks)
        if plan.kind == "round":
            # (a round launched ahead: the rows that finish with the one in flight are still
            # in the batch, and leave when its ids are read)
            assert plan.rows == [q for q in w.batch if q.rem > (q.rid in w.in_flight)]
            assert not w.joined and plan.rows
            assert plan.chunk_tokens <= max(0, s.max_tokens - len(plan.rows) * (s.k + 1))
            if s.preempt:  # every row's k + 1 new tokens fit, or one row is left
                assert w.kv.fits(len(plan.rows) * (s.k + 1)) or len(plan.rows) == 1
        else:
            assert plan.chunks and plan.chunk_tokens <= s.max_tokens
            assert w.kv.used <= w.kv.capacity
        if not s.preempt:
            assert w.kv.used <= w.kv.capacity
        assert w.kv.used == held(eng, w)
        for seq in plan.rows:  # the KV holds every token but the last generated one, and
            # the inputs of a round launched ahead (kestrel_rt/serve/ahead.py)
            assert w.target.kv.length(seq.slot) == seq.ctx - 1 + (seq.rid in w.in_flight)
        for job, _ in plan.chunks:
            assert w.target.kv.length(job.seq.slot) == job.done


def held(eng, w) -> int:
    """The KV charge `w` should hold: every request it has, charged as the simulator does."""
    s = eng.settings
    seqs = w.batch + w.joined
    if s.preempt:
        total = sum(seq.ctx for seq in seqs) + sum(job.need for job in w.prefilling)
    else:
        total = sum(reservation(s, seq) for seq in seqs + [j.seq for j in w.prefilling])
    for link in eng.links:  # what it prefilled and handed over, until the copy lands
        if w is link.src:
            total += sum(t.held for t in list(link.waiting) + list(link.moving))
    return total


def check_run(served, reference, sc: Scenario) -> None:
    """Every request finished with its drawn output length, in order of its life, and its
    tokens are plain greedy generation's."""
    records = served.trace.requests
    assert len(records) == sc.workload.requests
    for rec, out in zip(records, served.outputs):
        assert rec.finish is not None
        assert sum(rec.emit_counts) == rec.output_tokens == len(out)
        assert rec.arrival <= rec.prefill_start <= rec.emit_times[0] <= rec.finish
        assert rec.emit_times == sorted(rec.emit_times) and rec.emit_times[-1] == rec.finish
    same_as_greedy(served, reference)


def same_as_greedy(served, reference) -> None:
    """Each request's tokens are plain greedy generation's of its prompt."""
    longest = max(len(out) for out in served.outputs)
    expected = generate(reference, served.prompts, longest).token_ids
    for i, out in enumerate(served.outputs):
        assert out == expected[i][:len(out)], f"request {i}"


def all_at_once(n: int) -> dict:
    """Closed-loop clients that send every request at time 0: the steps then do not depend
    on how fast this machine runs them."""
    return {"process": "closed", "concurrency": n, "think_time_s": 0}


def test_colocated_mixed_preempts_and_recomputes(folder, reference):
    sc = scenario(folder, {"max_batch": 4, "max_batched_tokens": 24, "prefill_chunk": 16,
                           "kv_capacity_tokens": 80, "on_kv_full": "preempt"}, requests=12,
                  arrivals=all_at_once(12))
    limits = Limits()
    served = serve(sc, "cpu", observer=limits)
    check_run(served, reference, sc)
    assert served.trace.meta["preemptions"] > 0
    assert sum(r.preemptions for r in served.trace.requests) == served.trace.meta["preemptions"]
    assert "colocated:round+chunks" in limits.kinds  # chunks rode in decode steps
    kinds = {s.kind for s in served.trace.spans}
    assert kinds == {"prefill", "decode", "queue_wait"}
    mixed = [s for s in served.trace.spans if s.kind == "prefill" and any(
        d.kind == "decode" and (d.start, d.end) == (s.start, s.end) for d in served.trace.spans)]
    assert mixed  # a mixed step: decode and prefill spans of the same start and end


def test_colocated_alternate_waits_for_kv(folder, reference):
    sc = scenario(folder, {"max_batch": 3, "max_batched_tokens": 32, "prefill_chunk": 8,
                           "prefill_schedule": "alternate", "kv_capacity_tokens": 70,
                           "on_kv_full": "wait"}, requests=10)
    limits = Limits()
    served = serve(sc, "cpu", observer=limits)
    check_run(served, reference, sc)
    assert served.trace.meta["preemptions"] == 0
    assert "colocated:round+chunks" not in limits.kinds


@pytest.mark.parametrize(("threads", "order"), [(False, "fifo"), (False, "shortest-first"),
                                               (True, "fifo")],
                         ids=["turns", "turns-shortest-first", "threads"])
def test_disaggregated_hands_kv_over(folder, reference, threads, order):
    sc = scenario(folder, {"mode": "disaggregated", "max_batch": 3, "max_batched_tokens": 32,
                           "prefill_chunk": 16, "kv_capacity_tokens": 60,
                           "decode_queue": order}, requests=10,
                  arrivals=all_at_once(10))
    limits = Limits()
    served = serve(sc, "cpu", observer=limits, threads=threads)
    check_run(served, reference, sc)
    if not threads:  # taking turns, the steps are the same on any machine
        assert served.trace.meta["preemptions"] > 0  # recomputed by the prefill worker
    spans = served.trace.spans
    transfers = [s for s in spans if s.kind == "kv_transfer"]
    multi = [r for r in served.trace.requests if r.output_tokens > 1]
    assert {s.worker for s in transfers} == {"link0"}
    assert {r for s in transfers for r in s.requests} == {r.id for r in multi}
    for s in transfers:  # the prompt's KV (with the tokens of a preempted one's recompute)
        assert s.tokens >= served.trace.requests[s.requests[0]].prompt_tokens
    for rec in multi:  # the first token reaches the client with the KV, after its transfer
        moved = min(s.end for s in transfers if rec.id in s.requests)
        assert rec.emit_times[0] >= moved
    assert {s.worker for s in spans if s.kind == "decode"} == {"decode0/target"}
    assert {s.worker for s in spans if s.kind == "prefill"} == {"prefill0/target"}
    assert served.trace.meta["threads"] is threads


class Ahead(Limits):
    """Limits, counting the rounds launched ahead of the host."""

    def __init__(self):
        super().__init__()
        self.ahead = 0

    def __call__(self, eng, w, plan):
        super().__call__(eng, w, plan)
        self.ahead += bool(w.in_flight)


@pytest.mark.parametrize("kv", [{"on_kv_full": "wait"},
                                {"on_kv_full": "preempt", "kv_capacity_tokens": 400}])
def test_steady_rounds_run_ahead_and_give_greedy_tokens(folder, reference, kv):
    sc = scenario(folder, {"max_batch": 4, **kv}, requests=4, prompt=(4, 12), output=(12, 40),
                  arrivals={"process": "closed", "concurrency": 4, "think_time_s": 0})
    seen = Ahead()
    served = serve(sc, "cpu", observer=seen)
    check_run(served, reference, sc)
    assert seen.ahead > 10  # most rounds, once every prompt is in
    assert served.trace.meta["decode_rounds_ahead"] == seen.ahead
    decode = [s for s in served.trace.spans if s.kind == "decode"]
    assert len(decode) >= max(r.output_tokens for r in served.trace.requests) - 1


class Changed(Ahead):
    """Ahead, also counting the rounds launched ahead over other rows than the round in
    flight (a row that finished with it left, or a request from the decode queue joined)."""

    def __init__(self):
        super().__init__()
        self.changed = 0

    def __call__(self, eng, w, plan):
        super().__call__(eng, w, plan)
        if w.in_flight and {seq.rid for seq in plan.rows} != w.in_flight:
            self.changed += 1


@pytest.mark.parametrize("kv", ["wait", "preempt"])
def test_a_decode_worker_runs_ahead_while_requests_join_and_leave(folder, reference, kv):
    sc = scenario(folder, {"mode": "disaggregated", "max_batch": 3, "max_batched_tokens": 32,
                           "prefill_chunk": 16, "kv_capacity_tokens": 400,
                           "on_kv_full": kv}, requests=16, output=(2, 24),
                  arrivals=all_at_once(16))
    seen = Changed()
    served = serve(sc, "cpu", observer=seen, threads=True)
    check_run(served, reference, sc)  # the joiners' first inputs are their own last tokens
    assert seen.changed > 0 and seen.ahead > seen.changed
    assert served.trace.meta["decode_rounds_ahead"] == seen.ahead


def test_threads_run_under_the_switch_interval_asked_for(folder, reference):
    """serve(switch_interval_s=...): the workers' threads step under it; the interpreter's
    own value comes back after the run."""
    sc = scenario(folder, {"mode": "disaggregated", "max_batch": 3, "max_batched_tokens": 32,
                           "prefill_chunk": 16, "kv_capacity_tokens": 400}, requests=6,
                  output=(2, 8), arrivals=all_at_once(6))
    before, seen = sys.getswitchinterval(), set()

    def observe(eng, w, plan):
        seen.add(sys.getswitchinterval())

    served = serve(sc, "cpu", observer=observe, threads=True, switch_interval_s=2.5e-4)
    check_run(served, reference, sc)
    assert seen == {2.5e-4} and sys.getswitchinterval() == before


def test_closed_loop_keeps_concurrency(folder, reference):
    sc = scenario(folder, {"max_batch": 4, "kv_capacity_tokens": 200}, requests=7,
                  arrivals={"process": "closed", "concurrency": 2, "think_time_s": 0})
    served = serve(sc, "cpu", observer=Limits())
    check_run(served, reference, sc)
    records = served.trace.requests
    for rec in records[2:]:  # each later request is sent when an earlier one finishes
        assert any(abs(rec.arrival - r.finish) < 1e-9 for r in records if r.id < rec.id)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["colocated-mixed", "colocated-alternate", "disaggregated"]),
    max_batch=st.integers(1, 4), max_tokens=st.integers(4, 48), chunk=st.integers(1, 24),
    slack=st.integers(-4, 24), preempt=st.booleans(), order=st.sampled_from(["fifo", "shortest-first"]),
    requests=st.integers(2, 8), prompt_high=st.integers(1, 24), output_high=st.integers(1, 24),
    closed=st.booleans(), seed=st.integers(0, 2**16), k=st.sampled_from([0, 0, 2]),
)
def test_any_small_workload_finishes_or_is_refused(
        folder, reference, mode, max_batch, max_tokens, chunk, slack, preempt, order,
        requests, prompt_high, output_high, closed, seed, k):
    capacity = max(1, prompt_high + output_high + k + 1 + slack)  # near the longest
    serving = {"max_batch": max_batch,
               "max_batched_tokens": max(max_tokens, max_batch * (k + 1)),
               "prefill_chunk": chunk, "kv_capacity_tokens": capacity,
               "on_kv_full": "preempt" if preempt else "wait"}
    if mode == "disaggregated":
        serving.update(mode="disaggregated", decode_queue=order)
    else:
        serving["prefill_schedule"] = mode.split("-")[1]
    arrivals = {"process": "closed", "concurrency": 2} if closed else None
    sc = scenario(folder, serving, requests, (1, prompt_high), (1, output_high), seed, arrivals,
                  k)
    try:
        served = serve(sc, "cpu", observer=Limits(), threads=False)
    except KestrelError as err:  # refused with a reason: the longest request cannot fit
        assert "kv_capacity_tokens" in str(err)
        event("refused")
        return
    event(f"ran, {served.trace.meta['preemptions'] > 0 and 'with' or 'no'} preemptions, k={k}")
    check_run(served, reference, sc)
