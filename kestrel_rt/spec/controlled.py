"""Controlled acceptance: the real draft, verify and correction work, a drawn accepted length.

On dummy weights a random draft and target never agree, so the speedup of a draft that
would agree with probability alpha cannot be measured organically. Controlled mode runs
every forward as usual and takes the number of accepted draft tokens from the simulator's
acceptance model (kestrel_sim/acceptance.py: alpha, independent per token, the accepted
length being the first failure; per_position[i] = P(accept i | accepted 0..i-1); or a
trace of measured lengths), drawn by inverse CDF with one uniform per request per round
from that request's own numpy Generator (accept_rng: the simulator's rule, imported so the
two cannot drift), then capped by what the sequence may still emit. The emitted tokens
are the accepted draft tokens and the target's token after them, so the output is not the
target's own: results are marked `controlled` in the statistics (and the trace).
Same draws for the same seed, alone or batched.
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.acceptance import AcceptanceModel, accept_rng, build_acceptance
from kestrel_sim.scenario import Acceptance

__all__ = ["ControlledAcceptance", "accept_rng"]  # accept_rng: the simulator's own rule


class ControlledAcceptance:
    """Accepted lengths from an acceptance model, for k draft tokens per round."""

    def __init__(self, acceptance: Acceptance, k: int) -> None:
        self.model: AcceptanceModel = build_acceptance(acceptance, k)

    def draw(self, rngs: list[np.random.Generator], limits: list[int]) -> list[int]:
        """One accepted length per sequence, each at most its limit."""
        return [min(int(self.model.sample(1, rng)[0]), limit)
                for rng, limit in zip(rngs, limits)]
