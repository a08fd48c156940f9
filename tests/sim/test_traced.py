"""kestrel_sim/traced.py: the share of a run (and of a worker's working time) its spans
cover."""

from __future__ import annotations

import pytest

from kestrel_sim.trace import RequestRecord, Span, Trace
from kestrel_sim.traced import length, merged, overlap, traced_share


def test_intervals_merge_and_intersect():
    assert merged([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert length([(0, 2), (1, 3), (10, 11)]) == 4
    assert overlap([(0, 2), (3, 6)], [(1, 4), (5, 10)]) == 1 + 1 + 1
    assert overlap([], [(0, 1)]) == 0


def span(kind, worker, start, end):
    return Span(kind, worker, start, end, [0], 1, 0)


def test_idle_time_counts_against_the_run_but_not_the_working_share():
    # two requests with a gap between them; the decode worker idle in it
    reqs = [RequestRecord(0, 0.0, 8, 4, prefill_start=0.0, decode_start=1.0, finish=3.0,
                          emit_times=[1.0, 3.0], emit_counts=[1, 3]),
            RequestRecord(1, 6.0, 8, 4, prefill_start=6.0, decode_start=7.0, finish=9.0,
                          emit_times=[7.0, 9.0], emit_counts=[1, 3])]
    spans = [span("prefill", "prefill0/target", 0.0, 1.0),
             span("prefill", "prefill0/target", 6.0, 7.0),
             span("decode", "decode0/target", 1.0, 2.9),  # 0.1 s of untraced host time
             span("decode", "decode0/target", 7.0, 9.0),
             span("queue_wait", "queue/prefill", 0.0, 6.0),  # not a stage
             span("kv_transfer", "link0", 1.0, 1.2)]
    got = traced_share(Trace(spans, reqs, {}))
    assert set(got) == {"prefill0/target", "decode0/target"}
    assert got["decode0/target"]["run"] == pytest.approx(3.9 / 9)
    assert got["decode0/target"]["working"] == pytest.approx(3.9 / 4)
    assert got["prefill0/target"]["working"] == pytest.approx(1.0)


def test_a_colocated_worker_works_from_prefill_to_finish():
    reqs = [RequestRecord(0, 0.0, 8, 2, prefill_start=0.5, decode_start=1.0, finish=2.0,
                          emit_times=[1.0, 2.0], emit_counts=[1, 1])]
    spans = [span("prefill", "gpu0/target", 0.5, 1.0), span("decode", "gpu0/target", 1.0, 1.5),
             span("draft", "gpu0/draft", 1.5, 2.0)]
    got = traced_share(Trace(spans, reqs, {}))
    assert got["gpu0/target"] == pytest.approx({"run": 0.5, "working": 1 / 1.5})
    assert got["gpu0/draft"]["working"] == pytest.approx(0.5 / 1.5)
    assert got["gpu0"] == pytest.approx({"run": 0.75, "working": 1.0})  # the loop as one
    assert traced_share(Trace([], [], {})) == {}
