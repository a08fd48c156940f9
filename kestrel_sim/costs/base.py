"""The StageCost interface.

A step runs one stage over `batch` sequences x `m` new tokens at `context` cached tokens
each. A *mixed* step (colocated `prefill_schedule: mixed`, as vLLM's chunked prefill)
is one target forward that carries a decode or verify step plus a prefill `Chunk`;
`mixed_seconds` prices it. Each implementation documents its rule; all keep
    max(step alone, chunk alone) <= mixed_seconds <= step alone + chunk alone
(one forward does at least the work of either part, and never costs more than the two
run apart).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

STAGES = ("prefill", "draft", "verify", "correction", "decode")


class Chunk(NamedTuple):
    """The prefill part of a mixed step: `batch` prompts x `m` tokens (mean) each, at
    `context` tokens (mean) already prefilled per prompt."""

    batch: int
    m: float
    context: float

    @property
    def tokens(self) -> float:
        return self.batch * self.m


class StageCost(Protocol):
    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        """Time of one step of `batch` sequences x `m` new tokens at `context` cached tokens."""
        ...

    def mixed_seconds(self, stage: str, batch: int, m: float, context: float,
                      chunk: Chunk) -> float:
        """Time of one forward carrying a `stage` step (decode or verify) and `chunk`."""
        ...
