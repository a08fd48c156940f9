"""Requests: the scenario's workload drawn as the simulator draws it, each a Sequence of
token ids the engine grows.

`draw_requests` takes arrival times, prompt and output lengths from
`kestrel_sim.workload.draw_workload` with `numpy.random.default_rng(workload.seed)`, exactly
the simulator's first draws, so the same seed gives the same requests on both sides. Prompt
token ids (their content does not matter on dummy weights) come from a second generator,
seeded (seed, 1), so they never shift the simulator's stream. Output lengths are forced:
a request emits exactly its drawn number of tokens (end-of-sequence ids are ignored).
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.trace import RequestRecord
from kestrel_sim.workload import DrawnWorkload, draw_workload
from kestrel_sim.workload_spec import Workload


class Sequence:
    """One request: its tokens (prompt, then generated), its KV slot on the worker that holds
    it, and its RequestRecord."""

    __slots__ = ("output_len", "prompt_len", "record", "rid", "slot", "spec", "tokens")

    def __init__(self, rid: int, prompt: list[int], output_len: int):
        self.rid = rid
        self.tokens = list(prompt)  # prompt + generated token ids
        self.prompt_len = len(prompt)
        self.output_len = output_len  # forced: exactly this many are generated
        self.slot: int | None = None  # KV cache row on the worker holding it, else None
        self.spec = None  # its SpecSequence (sharing `tokens`) once it speculates
        self.record = RequestRecord(id=rid, arrival=0.0, prompt_tokens=len(prompt),
                                    output_tokens=output_len)

    @property
    def ctx(self) -> int:
        """Tokens of the sequence (the simulator's ctx: prompt + generated)."""
        return len(self.tokens)

    @property
    def rem(self) -> int:
        """Output tokens still to generate."""
        return self.output_len - (len(self.tokens) - self.prompt_len)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def prompt_ids(seed: int, lengths: np.ndarray, vocab_size: int) -> list[list[int]]:
    """Seeded prompt token ids, one list per request, each id in 0..vocab_size-1."""
    rng = np.random.default_rng([seed, 1])
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]


def draw_requests(workload: Workload, vocab_size: int) -> tuple[DrawnWorkload, list[Sequence]]:
    """The simulator's draw of `workload` and one Sequence per request."""
    drawn = draw_workload(workload, np.random.default_rng(workload.seed))
    prompts = prompt_ids(workload.seed, drawn.prompt, vocab_size)
    seqs = [Sequence(i, p, int(n)) for i, (p, n) in enumerate(zip(prompts, drawn.output))]
    return drawn, seqs
