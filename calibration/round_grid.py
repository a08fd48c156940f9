"""The round section of a calibration grid: whole speculative rounds, timed as serving runs
them, and what they cost in the time estimate. No torch here (the timing is
calibration/rounds.py).

    round:                       # the target and the draft on a GPU, each its own backend
      batches: [1, 2, 4, 8, 16, 32]
      k: [1, 2, 4, 8]
      contexts: [512]

Each combination is a point of the bench `spec@gpu` (grid.expand: only with the target and
a draft on the GPU): stage `round`, `batch` sequences, M = k + 1 (the verify's tokens per
sequence), `context` the sequences' length in tokens. Its record becomes a Measurement of
stage round (kestrel_sim/profile.py): the round's wall time, every proposal rejected, so
what it costs beyond its draft steps and its verify is the serving loop's per-round host
time (acceptance, the host's read of the round, the rollback, the gap before the next
round's first draft step). k = 0 is a plain decode round (the target alone): what serving's
loop adds to a decode step where it cannot launch the next one ahead of the host
(kestrel_rt/serve/ahead.py).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from calibration.values import MAX_K, Batches, KsOrZero, at_most_max_k, sizes
from kestrel_sim.schema_base import StrictModel

# The estimate's host time per round beyond its steps (H200, issue 23: a round cost about
# 1 ms more than its stages); erring long, as the estimate does.
ROUND_HOST_S = 1.5e-3
# Proposals per round where a draft step is timed inside rounds (grid draft.cpu.timed:
# in_rounds, calibration/draft_rounds.py): the step timed first, then one more, as serving's
# first draft step and the one after it.
DRAFT_ROUND_K = 2
Lengths = sizes("context")  # a sequence's tokens before the round: at least one


class RoundGrid(StrictModel):
    """Whole speculative rounds of `batches` sequences, k proposals each, the sequences
    `contexts` tokens long (target and draft caches holding all but the last)."""

    batches: Batches
    k: KsOrZero = Field(description=f"proposals per round, 0..{MAX_K} (the verify's M = k + "
                        "1; 0: a plain decode round, timed as serving runs one it cannot "
                        "launch ahead)")
    contexts: Lengths = Field(description="tokens per sequence before the round")

    @field_validator("k")
    @classmethod
    def _k(cls, v: list[int]) -> list[int]:
        return at_most_max_k(v)

    def shapes(self) -> list[tuple[int, int, int]]:
        """(batch, M = k + 1, context) of every point."""
        return [(b, k + 1, c) for b in self.batches for k in self.k for c in self.contexts]


def round_seconds(draft_step_s: float, verify_s: float, k: int, runs: int) -> float:
    """A round point's runs: k one-token draft steps, the verify, the host's time."""
    return runs * (k * draft_step_s + verify_s + ROUND_HOST_S)
