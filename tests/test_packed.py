"""kestrel_rt.packed: several groups in one forward give what each group's own forward gives."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.model import Qwen3Model
from kestrel_rt.packed import Group, forward_packed


def _pair(name: str):
    """Two models with the same weights and caches (one packed, one group by group)."""
    ref = tm.in_memory(name)
    shape = tm.shape_of(ref.config)
    models = []
    for _ in range(2):
        m = Qwen3Model(shape, tm.weights_of(ref), TorchBackend("cpu", torch.float32))
        m.allocate_kv(8, 64)
        models.append(m)
    return models


@pytest.mark.parametrize("name", ["untied", "moe_norm"])
def test_packed_groups_equal_their_own_forwards(name):
    packed, single = _pair(name)
    g = torch.Generator().manual_seed(3)
    vocab = packed.shape.vocab_size
    history = {0: 6, 1: 3, 2: 9, 3: 4, 4: 5}  # tokens already cached per slot
    for m in (packed, single):
        for slot in range(6):
            assert m.kv.allocate() == slot
    for slot, n in history.items():
        prompt = torch.randint(0, vocab, (1, n), generator=g)
        for m in (packed, single):
            m.forward(prompt, [slot])
    groups = [
        Group(torch.randint(0, vocab, (2, 1), generator=g), [0, 1]),  # decode
        Group(torch.randint(0, vocab, (2, 4), generator=g), [2, 3]),  # verify, k + 1 = 4
        Group(torch.randint(0, vocab, (1, 7), generator=g), [4], [5], last_only=True),  # chunk
        Group(torch.randint(0, vocab, (1, 3), generator=g), [5], last_only=True),  # new prompt
    ]
    got = forward_packed(packed, groups)
    for grp, out in zip(groups, got):
        want = single.forward(grp.tokens, grp.slots, grp.n_new, last_only=grp.last_only,
                              greedy=True)
        assert torch.equal(out, want)
    for slot in range(6):
        assert packed.kv.length(slot) == single.kv.length(slot)
        n = packed.kv.length(slot)
        for layer in range(packed.shape.num_hidden_layers):
            torch.testing.assert_close(packed.kv.k[layer, slot, :n], single.kv.k[layer, slot, :n])
            torch.testing.assert_close(packed.kv.v[layer, slot, :n], single.kv.v[layer, slot, :n])


def test_a_sequence_in_two_groups_is_refused():
    packed, _ = _pair("untied")
    slot = packed.kv.allocate()
    with pytest.raises(ValueError, match="two groups"):
        forward_packed(packed, [Group(torch.zeros(1, 1, dtype=torch.long), [slot]),
                                Group(torch.zeros(1, 2, dtype=torch.long), [slot])])


def test_a_mixed_step_as_serving_runs_it_equals_the_packed_forward():
    from kestrel_rt.packed import forward_mixed

    mixed, packed = _pair("untied")
    g = torch.Generator().manual_seed(5)
    vocab = mixed.shape.vocab_size
    for m in (mixed, packed):
        for slot in range(3):
            m.kv.allocate()
        m.forward(torch.randint(0, vocab, (2, 4), generator=torch.Generator().manual_seed(1)),
                  [0, 1])
    rows = Group(torch.randint(0, vocab, (2, 1), generator=g), [0, 1])
    chunk = Group(torch.randint(0, vocab, (1, 9), generator=g), [2], last_only=True)
    a = forward_mixed(mixed, rows, [chunk])
    b = forward_packed(packed, [rows, chunk])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert [mixed.kv.length(s) for s in range(3)] == [packed.kv.length(s) for s in range(3)]
