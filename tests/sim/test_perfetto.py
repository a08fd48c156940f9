"""Chrome / Perfetto export: every span becomes a complete event on its worker's track."""

from __future__ import annotations

import itertools
import json

import pytest

from kestrel_sim.perfetto import dumps_chrome_trace, to_chrome_trace, worker_pool
from kestrel_sim.trace import RequestRecord, Span, Trace


def _trace() -> Trace:
    spans = [
        Span("prefill", "gpu0/target", 0.0, 0.010, [0, 1], tokens=1024),
        Span("draft", "gpu0/draft", 0.010, 0.012, [0, 1], tokens=2),
        Span("verify", "gpu0/target", 0.012, 0.020, [0, 1], tokens=6, proposed=2,
             accepted=[2, 0]),
        Span("kv_transfer", "link0", 0.020, 0.021, [1]),
        Span("queue_wait", "prefill_queue", 0.0, 0.005, [1]),
    ]
    reqs = [
        RequestRecord(id=0, arrival=0.0, prompt_tokens=512, output_tokens=4, prefill_start=0.0,
                      decode_start=0.010, finish=0.020, emit_times=[0.010, 0.020],
                      emit_counts=[1, 3]),
        RequestRecord(id=1, arrival=0.0, prompt_tokens=512, output_tokens=2,
                      prefill_start=0.002, decode_start=0.012, finish=0.020,
                      emit_times=[0.010, 0.020], emit_counts=[1, 1]),
    ]
    return Trace(spans=spans, requests=reqs, meta={"name": "t", "source": "sim"})


def test_worker_pool_names():
    assert worker_pool("gpu0/draft") == ("gpu0", "draft")
    assert worker_pool("prefill3") == ("prefill", "prefill3")
    assert worker_pool("link") == ("link", "link")


def test_spans_become_complete_events_in_microseconds():
    doc = to_chrome_trace(_trace())
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["prefill", "draft", "verify", "kv_transfer"]
    verify = complete[2]
    assert verify["ts"] == pytest.approx(12_000)
    assert verify["dur"] == pytest.approx(8_000)
    assert verify["args"]["accepted"] == [2, 0]
    # target and draft share the gpu0 process on separate threads; the link has its own
    assert complete[0]["pid"] == complete[1]["pid"] != complete[3]["pid"]
    assert complete[0]["tid"] != complete[1]["tid"]
    assert complete[0]["tid"] == verify["tid"]


def test_track_names_and_request_waits():
    events = to_chrome_trace(_trace())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"gpu0", "target", "draft", "link", "link0", "requests"} <= names
    begins = [e for e in events if e["ph"] == "b"]
    ends = [e for e in events if e["ph"] == "e"]
    assert len(begins) == len(ends)
    # the trace's own queue_wait span, and no derived waits on top of it
    assert {(e["name"], e["id"]) for e in begins} == {("prefill_queue", 1)}
    assert begins[0]["ts"] == 0 and ends[0]["ts"] == pytest.approx(5_000)


def test_waits_derived_from_records_without_queue_wait_spans():
    trace = _trace()
    trace.spans = [s for s in trace.spans if s.kind != "queue_wait"]
    events = to_chrome_trace(trace)["traceEvents"]
    waits = {(e["name"], e["id"]) for e in events if e["ph"] == "b"}
    # request 1 queued 2 ms for prefill and waited 2 ms for decode; request 0 never waited
    assert waits == {("prefill_queue", 1), ("decode_queue", 1)}


def test_dumps_is_valid_json_with_counters():
    doc = json.loads(dumps_chrome_trace(_trace()))
    assert doc["displayTimeUnit"] == "ms"
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert counters and set(counters[0]["args"]) == {"prefill queue", "prefilling",
                                                     "decode queue", "running"}
    assert doc["otherData"]["source"] == "sim"


def test_large_batches_list_a_bounded_number_of_ids():
    trace = Trace(spans=[Span("decode", "gpu0/target", 0.0, 0.001, list(range(100)), tokens=100)])
    event = next(e for e in to_chrome_trace(trace)["traceEvents"] if e["ph"] == "X")
    assert event["args"]["batch"] == 100
    assert event["args"]["requests"][:3] == [0, 1, 2]
    assert event["args"]["requests"][-1] == "..."
    assert len(event["args"]["requests"]) == 33


def test_back_to_back_spans_do_not_overlap_on_their_track():
    # times whose microsecond values round in different directions
    t = [6.57515785951, 6.57920190149, 6.59957601151, 6.60000000049]
    spans = [Span("verify", "gpu0/target", a, b, [0]) for a, b in itertools.pairwise(t)]
    events = [e for e in to_chrome_trace(Trace(spans=spans))["traceEvents"] if e["ph"] == "X"]
    for e, nxt in itertools.pairwise(events):
        assert e["ts"] + e["dur"] <= nxt["ts"] + 1e-6
        assert e["dur"] == pytest.approx((nxt["ts"] - e["ts"]), abs=1e-6)
