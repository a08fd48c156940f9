"""A mixed step's time from its stages' fits: a decode or verify step carrying prompt chunks.

    ms = mixed_step_ms(step, pre, mixed, batch, m, context, chunk, per_chunk)

`step`, `pre` and `mixed` are StageModels (stage_model.py): the step's stage, the prefill
(or draft_prefill) fit and the mixed fit (None where the profile has no mixed rows). How
kestrel_sim.costs.profile uses them is its module docstring; `per_chunk` is the measuring
runtime's RuntimeInfo.chunks: each prompt chunk its own [1, m] forward after the step's.
"""

from __future__ import annotations

from kestrel_sim.costs.base import Chunk, Shares
from kestrel_sim.costs.stage_model import StageModel


def mixed_step_ms(step: StageModel, pre: StageModel, mixed: StageModel | None, batch: int,
                  m: float, context: float, chunk: Chunk, per_chunk: bool = False) -> float:
    """A step (`step`'s stage) carrying a prefill chunk, ms: the mixed fit where there is
    one (`mixed`), else the step plus the chunk's marginal cost on the prefill terms; kept
    between the longer of the two alone and their sum. `per_chunk`: the chunk's prompts
    run one forward each (per_chunk_parts)."""
    if per_chunk:
        parts = per_chunk_parts(step, pre, mixed, batch, m, context, chunk)
        ms = sum(t for t, _ in parts)
        alone, chunks_ms = step.ms(batch, m, context), chunk.batch * pre.ms(1, chunk.m,
                                                                            chunk.context)
        return min(alone + chunks_ms, max(ms, alone, chunks_ms))
    alone = step.ms(batch, m, context)
    chunk_alone = pre.ms(chunk.batch, chunk.m, chunk.context)
    if mixed is not None:
        ms = mixed.mixed_ms(batch, m, context, chunk)
    else:
        ms = alone + pre.marginal_ms(step.stage, batch, m, chunk)
    return min(alone + chunk_alone, max(ms, alone, chunk_alone))


def per_chunk_parts(step: StageModel | None, pre: StageModel, mixed: StageModel | None,
                    batch: int, m: float, context: float, chunk: Chunk
                    ) -> list[tuple[float, Shares]]:
    """A mixed step whose prompt chunks run one [1, m] forward each, after the step's
    forward: [(ms, Shares)] of its parts. The mixed fit, where there is one, prices the
    step's forward with ONE chunk: its rows were measured so (calibration/measure.py
    measure_mixed, chunk_batch 1, the rows' forward then the chunk's) and it is kept as
    fitted; asked for b chunks it would read them as one [b, m] forward (one overhead, one
    weight read, its correction at b x m chunk tokens: a row of one longer chunk), which
    the runtime never runs. The other chunks are forwards of their own on the prefill fit
    at (1, m); without a mixed fit, the step's forward alone and every chunk's."""
    one = Chunk(1, chunk.m, chunk.context)
    each = (pre.ms(1, chunk.m, chunk.context), pre.shares(1, chunk.m, chunk.context))
    if mixed is not None:
        first = (mixed.mixed_ms(batch, m, context, one), mixed.shares(batch, m, context, one))
        rest = chunk.batch - 1
    else:
        first = (step.ms(batch, m, context), step.shares(batch, m, context))
        rest = chunk.batch
    return [first, (rest * each[0], each[1])]
