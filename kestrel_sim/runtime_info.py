"""How the runtime that measured a profile runs its steps (Profile.runtime), so the simulator
prices each step at the shape it ran.

A profile's `runtime` (optional) says it: `batch_buckets`, the batch sizes its CUDA graphs
are captured at (a decode, verify, draft or correction step of b <= the largest and M <=
`max_m` tokens per sequence replays the graph of the smallest bucket >= b, its padding rows
computed and thrown away), so the simulator prices such a step at its bucket; empty or
absent, the runtime has no step graphs (the CPU, or graphs off) and each step runs at its
own batch; `prefill_buckets` likewise pads a prompt chunk's length (its prefill graph's;
only with step graphs); `chunks` says how a step's prompt chunks run: "per_chunk", one
forward per chunk ([1, n] each, as kestrel_rt/serve/forward.py and calibration run them,
with graphs or without), so b chunks of n tokens cost b times one chunk of n, or "batched"
(the default, what a file without the key means), one [b, n] forward. No `runtime` (older
files): each step at its own batch and length, its chunks batched.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GRAPH_STAGES = ("decode", "verify", "correction", "draft")  # replayed at a batch bucket


class RuntimeInfo(BaseModel):
    """How the measuring runtime runs its steps (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    batch_buckets: list[int] = Field(
        default_factory=list, description="batch sizes of the runtime's step graphs, "
        "ascending; empty: no step graphs (each step runs at its own batch)")
    max_m: int = Field(default=16, ge=1,
                       description="most tokens per sequence a step graph takes")
    prefill_buckets: list[int] | None = Field(
        default=None, description="prompt-chunk lengths the runtime's prefill graphs are "
        "captured at (a chunk of more than max_m tokens runs at the smallest >= its length); "
        "absent: prefill runs eagerly, at its own length")
    chunks: Literal["batched", "per_chunk"] = Field(
        default="batched", description="how a step's prompt chunks run: per_chunk, one "
        "forward per chunk ([1, n] each: b chunks cost b x one); batched (older profiles), "
        "one [b, n] forward")

    @model_validator(mode="after")
    def _ascending(self):
        for name in ("batch_buckets", "prefill_buckets"):
            b = getattr(self, name) or []
            if any(x < 1 for x in b) or any(x >= y for x, y in pairwise(b)):
                raise ValueError(f"{name} must be ascending positive sizes (got {b})")
        if self.prefill_buckets and not self.batch_buckets:
            raise ValueError("prefill_buckets need batch_buckets: a runtime without step "
                             "graphs (batch_buckets empty or absent) captures no prefill "
                             f"graphs (got prefill_buckets {self.prefill_buckets})")
        return self

    def run_shape(self, stage: str, batch: int, m: float) -> tuple[int, float]:
        """(batch, tokens per sequence) a `stage` step of batch x m runs at: a decode,
        verify, correction or draft step at its batch bucket, a prompt chunk at its prefill
        graph's length."""
        if stage in GRAPH_STAGES:
            return self.bucket(batch, m), m
        if stage == "prefill":
            return batch, self.prefill_tokens(m)
        return batch, m

    def prefill_tokens(self, m: float) -> float:
        """The tokens a prompt chunk of `m` runs at: its prefill graph's length, or itself
        (a chunk of at most max_m tokens replays a step graph of its own length; a longer
        one than the largest bucket, or no prefill graphs, runs eagerly)."""
        b = self.prefill_buckets
        if not b or m <= self.max_m or m > b[-1]:
            return m
        return next(x for x in b if x >= m)

    def bucket(self, batch: int, m: float) -> int:
        """The batch a step of `batch` x `m` runs at: its bucket, or itself (eager: past
        the graphs, or no step graphs)."""
        if not self.graphs or m > self.max_m or batch > self.batch_buckets[-1]:
            return batch
        return next(x for x in self.batch_buckets if x >= batch)

    @property
    def graphs(self) -> bool:
        """True where the runtime replays step graphs (steps padded to a batch bucket)."""
        return bool(self.batch_buckets)

    @property
    def per_chunk(self) -> bool:
        """True where a step's prompt chunks run one forward per chunk."""
        return self.chunks == "per_chunk"


def run_shape(runtime: RuntimeInfo | None, stage: str, batch: int, m: float
              ) -> tuple[int, float]:
    """RuntimeInfo.run_shape, or (batch, m) where no runtime pads steps."""
    return (batch, m) if runtime is None else runtime.run_shape(stage, batch, m)
