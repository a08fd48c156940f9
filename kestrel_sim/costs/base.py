"""The StageCost interface."""

from __future__ import annotations

from typing import Protocol

STAGES = ("prefill", "draft", "verify", "correction", "decode")


class StageCost(Protocol):
    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        """Time of one step of `batch` sequences x `m` new tokens at `context` cached tokens."""
        ...
