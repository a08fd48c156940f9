"""Decode rounds that run ahead (kestrel_rt/serve/ahead.py): the next round is enqueued before
the host reads this one's ids, only while the scheduler would plan the same round; the
tokens stay plain greedy generation's and the scheduler's limits hold at every round."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_serve_engine import Limits, check_run, scenario
from tiny_models import build

from kestrel_rt.serve import serve
from kestrel_rt.serve.ahead import steady
from kestrel_rt.serve.models import build_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build("tied", tmp_path_factory.mktemp("ahead") / "tied")


@pytest.fixture(scope="module")
def reference(folder):
    return build_model(str(folder), "cpu")


class Ahead(Limits):
    """Limits, counting the rounds launched ahead of the host."""

    def __init__(self):
        super().__init__()
        self.ahead = 0

    def __call__(self, eng, w, plan):
        super().__call__(eng, w, plan)
        self.ahead += w.in_flight


@pytest.mark.parametrize("kv", [{"on_kv_full": "wait"},
                                {"on_kv_full": "preempt", "kv_capacity_tokens": 400}])
def test_steady_rounds_run_ahead_and_give_greedy_tokens(folder, reference, kv):
    sc = scenario(folder, {"max_batch": 4, **kv}, requests=4, prompt=(4, 12), output=(12, 40),
                  arrivals={"process": "closed", "concurrency": 4, "think_time_s": 0})
    seen = Ahead()
    served = serve(sc, "cpu", observer=seen)
    check_run(served, reference, sc)
    assert seen.ahead > 10  # most rounds, once every prompt is in
    decode = [s for s in served.trace.spans if s.kind == "decode"]
    assert len(decode) >= max(r.output_tokens for r in served.trace.requests) - 1


def engine(queue=(), arrival=None, now=0.0, preempt=False):
    return SimpleNamespace(settings=SimpleNamespace(preempt=preempt, k=0),
                           prefill_queue=list(queue), decode_queues={"d": []},
                           arrivals=SimpleNamespace(next_time=lambda: arrival),
                           now=lambda: now)


def worker(role="colocated", prefilling=(), joined=(), round_s=0.004, fits=True):
    return SimpleNamespace(role=role, name="d", prefilling=list(prefilling),
                           joined=list(joined), round_s=round_s,
                           kv=SimpleNamespace(fits=lambda n: fits))


ROWS = [SimpleNamespace(rem=5), SimpleNamespace(rem=2)]


def test_the_same_round_again_only_while_nothing_changes():
    assert steady(engine(), worker(), ROWS)
    assert not steady(engine(), worker(), [*ROWS, SimpleNamespace(rem=1)])  # one finishes
    assert not steady(engine(queue=["job"]), worker(), ROWS)  # a prompt to admit
    assert not steady(engine(), worker(prefilling=["job"]), ROWS)
    assert not steady(engine(), worker(joined=["seq"]), ROWS)
    assert not steady(engine(arrival=0.003, now=0.0), worker(round_s=0.004), ROWS)
    assert steady(engine(arrival=0.005, now=0.0), worker(round_s=0.004), ROWS)
    assert steady(engine(arrival=0.001), worker(role="decode"), ROWS)  # arrivals: not its own
    assert not steady(engine(preempt=True), worker(fits=False), ROWS)  # KV for both rounds
    assert steady(engine(preempt=True), worker(fits=True), ROWS)
