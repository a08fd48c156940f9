"""One running request of the speculative decoder: the state its caller owns between rounds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SpecSequence:
    """A request's tokens, KV slots (one in each model's cache), limits and generators.

    `tokens` is prompt + generated. The target's cache holds every token but the last; the
    draft's the same, or one fewer (see kestrel_rt/spec/round.py). `generator` draws this
    request's uniforms (sampling), `accept_rng` its controlled accepted lengths; neither is
    shared, so a request does the same alone or batched.
    """

    request: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    target_slot: int
    draft_slot: int
    eos: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    accept_rng: np.random.Generator | None = None
    done: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def remaining(self, room: int) -> int:
        """Tokens it may still emit: under max_new_tokens, and prompt + generated <= room."""
        if self.done:
            return 0
        return max(0, min(self.max_new_tokens - (len(self.tokens) - self.prompt_len),
                          room - len(self.tokens)))

    def emit(self, new: list[int], room: int) -> list[int]:
        """Append the round's tokens up to the first end-of-sequence token and the limits;
        marks the sequence done when it can go no further. Returns what was appended."""
        new = new[: self.remaining(room)]
        stop = next((i for i, t in enumerate(new) if t in self.eos), None)
        if stop is not None:
            new = new[: stop + 1]
        self.tokens.extend(new)
        self.done = stop is not None or self.remaining(room) == 0
        return new
