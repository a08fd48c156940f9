"""The overlap section of a calibration grid: steps of the two disaggregated workers timed
while they run at once on one GPU, and their rows in the Profile. No torch here (the
timing is calibration/overlap.py).

    overlap:                     # two instances of the target, two streams of one GPU
      batches: [4, 32]           # the decode worker's rows: decode (k 0) or verify (k + 1)
      k: [0, 4]
      contexts: [1024]
      chunks: [512, 2048]        # the prefill worker's prompt chunk, one forward
      chunk_contexts: [0]
      timed: [decode, prefill]   # which of the two is timed while the other loops beside it
      draft_batches: [4, 32]     # the decode worker's draft steps (the draft model, M = 1)
      served_contexts: [2048]    # and (defaults) the decode side as the disaggregated
      served_batches: [1, 8]     #   scenarios serve it (light loads: small batches at ~2k
      served_draft_batches: [1, 8]  # contexts) beside the largest chunk, each side timed

Each combination is a point of the bench `pair@gpu` (grid.expand, GPU runs only): stage
`overlap`, the decode side's batch x M at context, the chunk's tokens at its context, and
`timed`. With `draft_batches` and a draft on the GPU (--draft), the speculative decode
worker's draft steps too: the draft model's one-token step of each batch at `contexts`,
beside the target's chunks, on a third instance (the draft) of the same bench, each side
timed (verify steps beside a chunk are the rows of `k` >= 1). Each record holds the timed
step's median beside the other step and alone (same run), and becomes a Measurement of stage overlap (kestrel_sim/profile.py): `step_stage`
the timed step's (decode, verify, draft or prefill) with its shape, `other_*` the other's;
a draft step is the draft model's (the profile's fingerprint.draft_model).

The `served_*` points (on by default) add the decode side at the shapes the disaggregated
scenarios serve on one GPU, beside the largest chunk: contexts about 2,100 and batches of
1-8 at light load, where the grid's own rows are at `contexts` with batches 4 and 32. The
kept H200 runs' draft steps of batch 1-4 beside a 2048-token chunk took 7-11x their time
alone, where the law fitted to the grid's rows (batch 4 at 1024: 4.8x) says 5-6x.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from calibration.values import at_most_max_k, sorted_at_least
from kestrel_sim.profile import Measurement
from kestrel_sim.schema_base import StrictModel


class OverlapGrid(StrictModel):
    """A decode worker's step (`batches` rows of k + 1 tokens at `contexts`) and a prefill
    worker's prompt chunk (`chunks` tokens at `chunk_contexts`), run at once on two streams
    of one GPU by two instances of the target; `timed` says which is timed (each: one
    point) while the other loops beside it."""

    batches: list[int] = Field(description="decode side: sequences per step")
    k: list[int] = Field(default=[0], description="decode side: 0 decode rows, k >= 1 "
                         "verify rows of k + 1 tokens")
    contexts: list[int] = Field(description="decode side: tokens cached per sequence")
    chunks: list[int] = Field(description="prefill side: prompt tokens of the chunk")
    chunk_contexts: list[int] = Field(default=[0], description="prefill side: prompt tokens "
                                      "already prefilled")
    timed: list[Literal["decode", "prefill"]] = Field(
        default=["decode", "prefill"], min_length=1,
        description="the side timed while the other loops beside it")
    draft_batches: list[int] = Field(
        default=[], description="the decode worker's draft steps (the draft model, M = 1, at "
        "`contexts`) beside the target's chunks; measured with a draft on the GPU only")

    served_contexts: list[int] = Field(
        default=[2048], description="the decode side's contexts as served: the served_* "
        "points' (beside the largest chunk, at the first chunk context); [] for none")
    served_batches: list[int] = Field(
        default=[1, 8], description="decode and verify (each k) sequences per step at "
        "served_contexts")
    served_draft_batches: list[int] = Field(
        default=[1, 8], description="draft steps' sequences at served_contexts (with "
        "draft_batches: a draft on the GPU)")

    @field_validator("batches", "chunks")
    @classmethod
    def _sizes(cls, v: list[int], info) -> list[int]:
        return sorted_at_least(v, info.field_name.removesuffix("es").removesuffix("s"), 1)

    @field_validator("draft_batches", "served_batches", "served_draft_batches")
    @classmethod
    def _draft_batches(cls, v: list[int]) -> list[int]:
        return sorted_at_least(v, "batch", 1) if v else v

    @field_validator("served_contexts")
    @classmethod
    def _served_contexts(cls, v: list[int]) -> list[int]:
        return sorted_at_least(v, "context", 0) if v else v

    @field_validator("contexts", "chunk_contexts")
    @classmethod
    def _contexts(cls, v: list[int], info) -> list[int]:
        return sorted_at_least(v, "context", 0)

    @field_validator("k")
    @classmethod
    def _k(cls, v: list[int]) -> list[int]:
        return at_most_max_k(sorted_at_least(v, "k", 0))

    def shapes(self) -> list[tuple[str, int, int, int, int, int]]:
        """(timed, batch, M, context, chunk tokens, chunk context) of every point: the
        grid's, then the served ones (repeats dropped)."""
        grid = [(timed, b, k + 1, c, n, cc)
                for timed in self.timed for b in self.batches for k in self.k
                for c in self.contexts for n in self.chunks for cc in self.chunk_contexts]
        served = [(timed, b, k + 1, c, *self.served_chunk())
                  for timed in self.timed for b in self.served_batches for k in self.k
                  for c in self.served_contexts]
        return list(dict.fromkeys(grid + served))

    def draft_shapes(self) -> list[tuple[str, int, int, int, int]]:
        """(timed, batch, context, chunk tokens, chunk context) of every draft point: the
        grid's, then the served ones where the grid has draft points (repeats dropped)."""
        grid = [(timed, b, c, n, cc)
                for timed in self.timed for b in self.draft_batches
                for c in self.contexts for n in self.chunks for cc in self.chunk_contexts]
        served = [(timed, b, c, *self.served_chunk())
                  for timed in self.timed for b in self.served_draft_batches
                  for c in self.served_contexts] if self.draft_batches else []
        return list(dict.fromkeys(grid + served))

    def served_chunk(self) -> tuple[int, int]:
        """(tokens, context) of the chunk the served points are timed beside: the largest,
        at the first chunk context."""
        return self.chunks[-1], self.chunk_contexts[0]


COVER = 3.0  # the other step loops for at least COVER x the timed step's time alone


def overlap_seconds(step_s: float, chunk_s: float, timed: str, runs: int) -> float:
    """A point's time (calibration/overlap.py): the timed step alone, `runs` times; then
    `runs` times the other step looping over one of its own plus COVER x the timed step."""
    mine, other = (step_s, chunk_s) if timed == "decode" else (chunk_s, step_s)
    return runs * (mine + other + COVER * mine + other)


def decode_stage(p) -> str:
    """The stage of a point's decode-side step: the draft's, or the target's by M."""
    if p.decode_model == "draft":
        return "draft"
    return "decode" if p.m == 1 else "verify"


def overlap_measurement(rec) -> Measurement:
    """An overlap point's record (calibration/overlap.py OverlapRecord) as a Measurement."""
    p = rec.point
    step = (decode_stage(p), p.batch, p.m, p.context)
    chunk = ("prefill", 1, p.chunk_tokens, p.chunk_context)
    timed, other = (step, chunk) if p.timed == "decode" else (chunk, step)
    return Measurement(
        stage="overlap", step_stage=timed[0], batch=timed[1], tokens_per_seq=timed[2],
        context=timed[3], other_stage=other[0], other_batch=other[1],
        other_tokens_per_seq=other[2], other_context=other[3], alone_ms=rec.alone_ms,
        device="gpu", ms=rec.ms, samples=rec.samples, p10=rec.p10, p90=rec.p90)
