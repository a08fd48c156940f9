"""When a decode round runs ahead (kestrel_rt/serve/ahead.py): only while the scheduler would
plan the same round again. tests/test_serve_engine.py runs it: greedy tokens, the limits at
every round."""

from __future__ import annotations

from types import SimpleNamespace

from kestrel_rt.serve.ahead import steady


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


def test_the_next_inputs_keep_the_staying_rows_ids_and_add_the_joiners_tokens():
    import torch

    from kestrel_rt.serve.ahead import inputs

    rows = [SimpleNamespace(rid=i, tokens=[100 + i]) for i in range(4)]
    ids = torch.tensor([[10], [11], [12], [13]])  # [4, 1]: the round in flight's choices
    assert inputs(rows, ids, rows) is ids  # the same rows: the graph's own buffer
    first = inputs(rows, ids, rows[:2])  # the last two left: a view of the first rows
    assert first.tolist() == [[10], [11]] and first.data_ptr() == ids.data_ptr()
    joiner = SimpleNamespace(rid=9, tokens=[7, 8, 42])
    got = inputs(rows, ids, [rows[0], rows[2], rows[3], joiner])  # row 1 left, one joined
    assert got.tolist() == [[10], [12], [13], [42]]
    assert inputs(rows, ids, [rows[0], rows[1], joiner]).tolist() == [[10], [11], [42]]
