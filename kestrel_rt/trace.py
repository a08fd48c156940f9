"""The runtime's spans: each stage timed on the device that runs it, collected into a Trace.

    tracer = Tracer()                                   # t = 0 now
    with tracer.span("verify", "gpu0/target", [3, 7], tokens=10, context=512) as span:
        model.forward(...)
    span.accepted = [2, 4]                              # known after the step: fill in later
    spans = tracer.collect()                            # kestrel_sim.trace.Span, seconds

A span on a CUDA device is a pair of CUDA events recorded on the current stream around the
work, so it measures when the GPU ran it, not when the host enqueued it; a span on the CPU
(a CPU draft, a queue wait) reads the host clock. Both clocks share the origin taken when the
tracer is made (a reference event recorded, and synchronized, at that instant), so spans of
both kinds line up on one time axis with request arrivals and emissions measured by `now()`.
`collect()` waits for the device once and converts every span; nothing syncs before that.
`NullTracer` keeps nothing and costs nothing: benchmarks and plain generation use it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kestrel_sim.trace import Span, SpanKind


@dataclass(slots=True)
class OpenSpan:
    """A span being timed: its fields, then its start and end marks (CUDA events or host
    seconds since the tracer's origin). `accepted` (and the other counts) may be set after
    the span closes, until collect()."""

    kind: SpanKind
    worker: str
    requests: list[int]
    tokens: int = 0
    context: int = 0
    proposed: int = 0
    accepted: list[int] | None = None
    start: object = None
    end: object = None
    extra: dict = field(default_factory=dict)


class Tracer:
    """Times spans on `device` (CUDA events) and on the host; see the module docstring."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda"
        self.spans: list[OpenSpan] = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.origin = time.perf_counter()
        self.ref = None
        if self.cuda:
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record(torch.cuda.current_stream(self.device))
            self.ref.synchronize()
            self.origin = time.perf_counter()

    def now(self) -> float:
        """Host seconds since the origin."""
        return time.perf_counter() - self.origin

    def mark(self, on_device: bool) -> object:
        """A time mark: a CUDA event recorded on the current stream, or host seconds."""
        if on_device and self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return self.now()

    def open(self, kind: SpanKind, worker: str, requests: list[int], *, on_device: bool = True,
             **counts) -> OpenSpan:
        """Start a span (its start mark now); close() it after the work is enqueued."""
        span = OpenSpan(kind, worker, list(requests), **counts)
        span.start = self.mark(on_device)
        self.spans.append(span)
        return span

    def close(self, span: OpenSpan, on_device: bool = True) -> OpenSpan:
        span.end = self.mark(on_device)
        return span

    @contextmanager
    def span(self, kind: SpanKind, worker: str, requests: list[int], *, on_device: bool = True,
             **counts):
        """Time the block as one span (CUDA events where on_device and the tracer has a GPU,
        else the host clock)."""
        span = self.open(kind, worker, requests, on_device=on_device, **counts)
        try:
            yield span
        finally:
            self.close(span, on_device)

    def add(self, kind: SpanKind, worker: str, requests: list[int], start: float, end: float,
            **counts) -> OpenSpan:
        """A span measured elsewhere, in host seconds since the origin (a queue wait)."""
        span = OpenSpan(kind, worker, list(requests), start=start, end=end, **counts)
        self.spans.append(span)
        return span

    def seconds(self, mark: object) -> float:
        """A mark in seconds since the origin (a CUDA event must have completed)."""
        if isinstance(mark, float):
            return mark
        return self.ref.elapsed_time(mark) / 1e3

    def collect(self) -> list[Span]:
        """Every span so far as kestrel_sim Spans (waits for the device once), in start order;
        the tracer is emptied."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out = [Span(s.kind, s.worker, self.seconds(s.start), self.seconds(s.end), s.requests,
                    s.tokens, s.context, s.proposed, s.accepted) for s in self.spans]
        self.spans = []
        out.sort(key=lambda s: s.start)
        return out


class NullTracer(Tracer):
    """A tracer that records nothing (no events, no host reads beyond now())."""

    def __init__(self) -> None:
        self.device, self.cuda, self.spans, self.ref = None, False, [], None
        self.origin = time.perf_counter()

    def open(self, kind, worker, requests, *, on_device=True, **counts) -> OpenSpan:
        return OpenSpan(kind, worker, [])

    def close(self, span, on_device=True) -> OpenSpan:
        return span

    def add(self, kind, worker, requests, start, end, **counts) -> OpenSpan:
        return OpenSpan(kind, worker, [])

    def collect(self) -> list[Span]:
        return []
