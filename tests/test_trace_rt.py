"""kestrel_rt.trace on the CPU: spans on one clock, counts filled in after closing."""

from kestrel_rt.trace import NullTracer, Tracer


def test_spans_share_the_origin_and_keep_their_counts():
    tracer = Tracer()
    with tracer.span("verify", "cpu/target", [1, 2], tokens=10, context=40, proposed=4) as span:
        sum(range(20000))
    span.accepted = [2, 4]  # known after the step
    tracer.add("queue_wait", "queue/prefill", [3], 0.0, tracer.now())
    spans = tracer.collect()
    assert [s.kind for s in spans] == ["queue_wait", "verify"]  # sorted by start
    verify = spans[1]
    assert 0 <= verify.start < verify.end <= spans[0].end
    assert (verify.requests, verify.tokens, verify.context, verify.proposed,
            verify.accepted) == ([1, 2], 10, 40, 4, [2, 4])
    assert tracer.collect() == []  # emptied


def test_null_tracer_keeps_nothing():
    tracer = NullTracer()
    with tracer.span("decode", "cpu/target", [1]):
        pass
    tracer.add("queue_wait", "queue/prefill", [1], 0.0, 1.0)
    assert tracer.collect() == []
