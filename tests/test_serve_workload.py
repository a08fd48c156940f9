"""The serving engine's workload is the simulator's: the same seed gives the same arrival
times, prompt and output lengths; arrivals, queues and the KV budget behave as the
simulator's do."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_rt.serve import serve
from kestrel_rt.serve.arrivals import Arrivals
from kestrel_rt.serve.kv import SlotPool
from kestrel_rt.serve.queues import DecodeQueue, PrefillJob
from kestrel_rt.serve.requests import Sequence, draw_requests, prompt_ids
from kestrel_sim import simulate
from kestrel_sim.errors import KestrelError
from kestrel_sim.scenario import Scenario
from kestrel_sim.sim.kv import KVPool
from kestrel_sim.sim.slots import slots_per_worker
from kestrel_sim.workload import draw_workload


def scenario(folder, arrivals: dict, requests: int = 9) -> Scenario:
    return Scenario.load_from_dict({
        "name": "tiny", "hardware": "cpu-xeon", "model": str(folder),
        "serving": {"max_batch": 3, "kv_capacity_tokens": 200},
        "workload": {"arrivals": arrivals, "requests": requests,
                     "prompt_tokens": {"dist": "uniform", "low": 2, "high": 30},
                     "output_tokens": {"dist": "lognormal", "mean": 6, "std": 4, "min": 1,
                                       "max": 20},
                     "seed": 11},
    })


@pytest.mark.parametrize("arrivals", [
    {"process": "poisson", "rate": 300},
    {"process": "gamma", "rate": 300, "cv": 2.0},
    {"process": "closed", "concurrency": 2, "think_time_s": 0.001},
], ids=["poisson", "gamma", "closed"])
def test_same_requests_as_the_simulator(folder, arrivals):
    sc = scenario(folder, arrivals)
    simulated = simulate(sc).requests
    drawn, seqs = draw_requests(sc.workload, vocab_size=96)
    again = draw_workload(sc.workload, np.random.default_rng(sc.workload.seed))
    assert [s.prompt_len for s in seqs] == [r.prompt_tokens for r in simulated]
    assert [s.output_len for s in seqs] == [r.output_tokens for r in simulated]
    assert drawn.prompt.tolist() == again.prompt.tolist()
    measured = serve(sc, "cpu").trace.requests
    assert [r.prompt_tokens for r in measured] == [r.prompt_tokens for r in simulated]
    assert [r.output_tokens for r in measured] == [r.output_tokens for r in simulated]
    if drawn.arrivals is not None:  # open loop: sent at the drawn times, on both sides
        assert [r.arrival for r in measured] == pytest.approx([r.arrival for r in simulated])
        assert [r.arrival for r in measured] == drawn.arrivals.tolist()


def test_prompt_ids_are_seeded_and_in_the_vocabulary():
    lengths = np.array([3, 7, 1])
    a, b = prompt_ids(5, lengths, 96), prompt_ids(5, lengths, 96)
    assert a == b and [len(p) for p in a] == [3, 7, 1]
    assert all(0 <= t < 96 for p in a for t in p)
    assert prompt_ids(6, lengths, 96) != a


def test_closed_loop_sends_the_next_request_after_a_finish():
    from kestrel_sim.workload import DrawnWorkload

    drawn = DrawnWorkload(None, np.array([4, 4, 4, 4]), np.array([2, 2, 2, 2]),
                          concurrency=2, think_time_s=0.5)
    arrivals = Arrivals(drawn)
    assert arrivals.due(0.0) == [(0, 0.0), (1, 0.0)]
    assert arrivals.next_time() is None
    arrivals.finished(1.0)
    assert arrivals.next_time() == 1.5 and arrivals.due(1.4) == []
    assert arrivals.due(1.5) == [(2, 1.5)]
    arrivals.finished(2.0)
    arrivals.finished(2.1)  # no fifth request to send
    assert arrivals.due(9.0) == [(3, 2.5)] and arrivals.next_time() is None


def test_decode_queue_orders():
    seqs = [Sequence(i, [1] * n, 4) for i, n in enumerate([5, 2, 9, 2])]
    fifo, shortest = DecodeQueue("fifo"), DecodeQueue("shortest-first")
    for seq in seqs:
        fifo.push(seq)
        shortest.push(seq)
    assert [fifo.pop().rid for _ in seqs] == [0, 1, 2, 3]
    # fewest tokens in the sequence first; equal ones in the order they came
    assert [shortest.pop().rid for _ in seqs] == [1, 3, 0, 2]
    with pytest.raises(ValueError, match="shortest-first"):
        DecodeQueue("lifo")


def test_prefill_job_of_a_preempted_request_recomputes_its_tokens():
    seq = Sequence(0, [3, 4, 5], 6)
    seq.tokens += [7, 8]
    job = PrefillJob(seq)
    assert (job.need, job.done, seq.rem, seq.generated) == (5, 0, 4, [7, 8])


def test_kv_budget_and_slots():
    budget = KVPool(10)
    budget.take(7)
    assert budget.fits(3) and not budget.fits(4)
    budget.give(7)
    assert budget.used == 0

    class Cache:
        def __init__(self):
            self.lengths = {}

        def rollback(self, slot, length):
            self.lengths[slot] = length

    caches = [Cache(), Cache()]
    pool = SlotPool(caches, 2)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {0, 1} and not pool.can_allocate()
    assert all(c.lengths == {a: 0, b: 0} for c in caches)  # emptied in target and draft
    pool.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(a)


def test_slots_shrink_to_the_memory_but_never_below_max_batch():
    # 2 workers, 10 bytes a slot, 100 bytes of weights; each worker's caches have a scratch
    # slot more than their usable slots
    assert slots_per_worker(8, 4, 2, 10, 100, free=None, longest=50) == 8  # unknown: all
    assert slots_per_worker(8, 4, 2, 10, 100, free=1000, longest=50) == 8
    assert slots_per_worker(8, 4, 2, 10, 100, free=220, longest=50) == 5  # 2 x (5 + 1) x 10
    # a worker's workspace stays free: 20 bytes each leave room for 3 usable slots
    assert slots_per_worker(8, 3, 2, 10, 100, free=220, longest=50, reserve=20) == 3
    with pytest.raises(KestrelError, match=r"serving\.max_batch = 4 slots of 50 tokens"):
        slots_per_worker(8, 4, 2, 10, 100, free=170, longest=50)
