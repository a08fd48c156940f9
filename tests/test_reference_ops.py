"""The torch reference of the greedy-accept kernel (the one kernel with no TorchBackend op;
the backend ops' references are checked against transformers in test_backend_ops.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_rt.cuda.reference import greedy_accept


def _slow(draft: list[int], target: list[int]) -> tuple[int, int]:
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n, target[n]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_greedy_accept_is_the_longest_agreeing_prefix(batch, k, seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 3, (batch, k + 1), generator=g)  # small vocab: many agreements
    draft = torch.randint(0, 3, (batch, k), generator=g)
    acc, nxt = greedy_accept(draft, target)
    assert acc.dtype == torch.long and nxt.dtype == torch.long
    for b in range(batch):
        assert (int(acc[b]), int(nxt[b])) == _slow(draft[b].tolist(), target[b].tolist())


def test_all_accepted_gives_the_bonus_token():
    target = torch.tensor([[4, 5, 6, 7]])
    acc, nxt = greedy_accept(target[:, :3].clone(), target)
    assert acc.tolist() == [3] and nxt.tolist() == [7]


def test_first_rejected_gives_the_correction():
    acc, nxt = greedy_accept(torch.tensor([[1, 2]]), torch.tensor([[9, 2, 3]]))
    assert acc.tolist() == [0] and nxt.tolist() == [9]
