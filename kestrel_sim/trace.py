"""The Trace: what happened, as timed spans plus one record per request.

Both the simulator and the runtime write this; `kestrel_sim.metrics` reads only this.
Times are seconds from the start of the run. Spans and records are plain slotted
dataclasses so the simulator can append hundreds of thousands of them cheaply;
`Trace.load` validates a file through pydantic.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import TypeAdapter

SpanKind = Literal[
    "prefill", "draft", "verify", "correction", "decode", "kv_transfer", "queue_wait"
]


@dataclass(slots=True)
class Span:
    """One batch step (or a transfer, or a wait) on one worker."""

    kind: SpanKind
    worker: str  # e.g. "gpu0/target", "gpu0/draft", "prefill0", "link0"
    start: float  # s
    end: float  # s
    requests: list[int]  # request ids in the batch
    tokens: int = 0  # new tokens processed by the step (all requests)
    context: int = 0  # context tokens read by the step (all requests)
    proposed: int = 0  # verify: draft tokens proposed per request (k)
    accepted: list[int] | None = None  # verify: draft tokens accepted and kept, per request
    # (a request needing fewer tokens than the target accepted keeps only those)


@dataclass(slots=True)
class RequestRecord:
    """One request's life. Emissions are the times new output tokens became visible."""

    id: int
    arrival: float
    prompt_tokens: int
    output_tokens: int = 0  # tokens emitted so far (final: all)
    prefill_start: float | None = None  # first scheduled for prefill
    decode_start: float | None = None  # first scheduled for decode
    finish: float | None = None
    emit_times: list[float] = field(default_factory=list)  # s, one per emission
    emit_counts: list[int] = field(default_factory=list)  # tokens per emission
    preemptions: int = 0

    @property
    def first_token(self) -> float | None:
        return self.emit_times[0] if self.emit_times else None


@dataclass(slots=True)
class Trace:
    """Spans and request records of one run, with free-form metadata."""

    spans: list[Span] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # scenario name, source ("sim"|"hardware"), ...

    def to_dict(self) -> dict:
        """spans, requests and meta as plain data (fields a subclass adds are not part of it)."""
        return {"spans": [asdict(s) for s in self.spans],
                "requests": [asdict(r) for r in self.requests], "meta": self.meta}

    def save(self, path: str | Path) -> None:
        """Write as JSON atomically (a temp file renamed into place)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return _ADAPTER.validate_json(Path(path).read_bytes())


_ADAPTER = TypeAdapter(Trace)
