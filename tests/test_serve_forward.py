"""kestrel_rt/serve/forward.py on a model that returns what a CUDA graph replay returns: a
view of one static output buffer, overwritten by the next forward of the same shape."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kestrel_rt.serve.forward import prefill_forward


class StaticOutputModel:
    """forward(...) -> the last token + 1, written into one buffer whose view it returns
    (GraphModel's greedy replay: valid until the next forward of the same shape)."""

    def __init__(self) -> None:
        self.out = torch.zeros(1, dtype=torch.long)

    def forward(self, tokens, slots, last_only=False, greedy=False):
        self.out.fill_(int(tokens[0, -1]) + 1)
        return self.out[:1]


def job(tokens: list[int], done: int = 0, slot: int = 0):
    return SimpleNamespace(done=done, seq=SimpleNamespace(tokens=tokens, slot=slot))


def test_every_chunk_keeps_its_own_next_token():
    chunks = [(job([5, 6, 7]), 3), (job([10, 11, 12, 13], slot=1), 4), (job([40, 41]), 2)]
    assert prefill_forward(StaticOutputModel(), chunks).tolist() == [8, 14, 42]


def test_one_chunk_is_copied_out_too():
    model = StaticOutputModel()
    after = prefill_forward(model, [(job([1, 2, 3], done=1), 2)])
    model.forward(torch.tensor([[99]]), [0])
    assert after.tolist() == [4]
