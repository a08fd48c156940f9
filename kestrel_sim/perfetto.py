"""Trace -> Chrome / Perfetto trace JSON (open in https://ui.perfetto.dev or chrome://tracing).

Layout: one process per worker pool ("gpu0" for "gpu0/target" and "gpu0/draft", "prefill"
for "prefill0", ...), one thread per worker, a complete event (ph "X") per span. Request
waits are async events (ph "b"/"e") on a "requests" process, one lane per request: the
trace's queue_wait spans, or, for a trace without them, waits derived from the request
records: prefill queue (arrival -> prefill start) and decode queue (first token -> decode
start). Requests per state (time series bins) are counter events (ph "C"). Times are
microseconds.
"""

from __future__ import annotations

import json
import re

from kestrel_sim.timeseries import TimeSeries, compute_timeseries
from kestrel_sim.trace import Trace

US = 1e6
MAX_IDS_IN_ARGS = 32  # request ids listed in a span's args (batches may be large)
REQUESTS_PID = 0


def worker_pool(worker: str) -> tuple[str, str]:
    """("gpu0", "target") for "gpu0/target"; ("prefill", "prefill0") for "prefill0"."""
    if "/" in worker:
        pool, thread = worker.split("/", 1)
        return pool, thread
    return (re.sub(r"\d+$", "", worker) or worker), worker


def _ids(values: list[int]) -> str:
    """A JSON list of at most MAX_IDS_IN_ARGS integers, "..." marking the cut."""
    text = ",".join(map(str, values[:MAX_IDS_IN_ARGS]))
    return f"[{text},\"...\"]" if len(values) > MAX_IDS_IN_ARGS else f"[{text}]"


def _span_event(span, pid: int, tid: int) -> str:
    """One complete event as JSON text (written directly: traces hold ~1e6 spans)."""
    args = (f'"batch":{len(span.requests)},"tokens":{span.tokens},"context":{span.context},'
            f'"requests":{_ids(span.requests)}')
    if span.kind == "verify":
        args += f',"proposed":{span.proposed}'
        if span.accepted:
            args += f',"accepted":{_ids(span.accepted)},"accepted_total":{sum(span.accepted)}'
    # ts and end rounded alike, so a span ends exactly where the next one on its track starts
    ts, end = round(span.start * US, 3), round(span.end * US, 3)
    return (f'{{"name":"{span.kind}","ph":"X","pid":{pid},"tid":{tid},'
            f'"ts":{ts:.3f},"dur":{end - ts:.3f},"args":{{{args}}}}}')


def _async_pair(name: str, rid: int, start: float, end: float, args: dict | None = None):
    common = {"name": name, "cat": "request", "id": rid, "pid": REQUESTS_PID, "tid": 0}
    begin = {**common, "ph": "b", "ts": round(start * US, 3), "args": args or {}}
    return [begin, {**common, "ph": "e", "ts": round(end * US, 3)}]


def _derived_waits(r) -> list[dict]:
    """Queue waits of one request from its record (for traces without queue_wait spans)."""
    events: list[dict] = []
    if r.prefill_start is not None and r.prefill_start > r.arrival:
        events += _async_pair("prefill_queue", r.id, r.arrival, r.prefill_start,
                              {"prompt_tokens": r.prompt_tokens})
    first = r.first_token
    if first is not None and r.decode_start is not None and r.decode_start > first:
        events += _async_pair("decode_queue", r.id, first, r.decode_start)
    return events


def dumps_chrome_trace(trace: Trace, counters: bool = True,
                       timeseries: TimeSeries | None = None) -> str:
    """The trace as Chrome trace-event JSON text: {"traceEvents": [...], ...}. Counters come
    from `timeseries`, or the run's (a simulated run's own, or the whole Trace replayed)."""
    events: list[str] = []  # one JSON object per event
    pids: dict[str, int] = {}
    tids: dict[str, tuple[int, int]] = {}

    def add(event: dict) -> None:
        events.append(json.dumps(event, separators=(",", ":")))

    def ids_for(worker: str) -> tuple[int, int]:
        if worker not in tids:
            pool, thread = worker_pool(worker)
            if pool not in pids:
                pids[pool] = len(pids) + 1
                add({"ph": "M", "name": "process_name", "pid": pids[pool], "args": {"name": pool}})
            tid = sum(1 for p, _ in tids.values() if p == pids[pool]) + 1
            tids[worker] = (pids[pool], tid)
            add({"ph": "M", "name": "thread_name", "pid": pids[pool], "tid": tid,
                 "args": {"name": thread}})
        return tids[worker]

    add({"ph": "M", "name": "process_name", "pid": REQUESTS_PID, "args": {"name": "requests"}})
    has_waits = False
    for span in trace.spans:
        if span.kind == "queue_wait":
            has_waits = True
            for rid in span.requests:
                for event in _async_pair(span.worker, rid, span.start, span.end):
                    add(event)
            continue
        events.append(_span_event(span, *ids_for(span.worker)))

    for r in trace.requests:
        if not has_waits:  # a trace with its own waits is not given derived ones twice
            for event in _derived_waits(r):
                add(event)
        if r.finish is not None:
            add({"name": "finish", "cat": "request", "ph": "n", "id": r.id, "pid": REQUESTS_PID,
                 "tid": 0, "ts": round(r.finish * US, 3),
                 "args": {"output_tokens": r.output_tokens, "preemptions": r.preemptions}})

    if counters:
        ts = timeseries if timeseries is not None else compute_timeseries(trace)
        starts = [t - ts.bin_seconds / 2 for t in ts.time]  # a counter holds until the next
        for t, q, p, d, run in zip(starts, ts.prefill_queue, ts.prefilling, ts.decode_queue,
                                   ts.running):
            add({"name": "requests (bin mean)", "ph": "C", "pid": REQUESTS_PID,
                 "ts": round(t * US, 3),
                 "args": {"prefill queue": q, "prefilling": p, "decode queue": d,
                          "running": run}})

    other = {k: v if isinstance(v, (str, int, float, bool)) else json.dumps(v, default=str)
             for k, v in trace.meta.items()}
    head = json.dumps({"displayTimeUnit": "ms", "otherData": other})[:-1]
    return head + ',"traceEvents":[\n' + ",\n".join(events) + "\n]}"


def to_chrome_trace(trace: Trace, counters: bool = True) -> dict:
    """The Chrome trace document as a dict (parsed back from `dumps_chrome_trace`)."""
    return json.loads(dumps_chrome_trace(trace, counters))
