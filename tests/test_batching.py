"""Batching, ragged prefill, KV rollback and model isolation (one backend per model)."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from kestrel_rt.backend import BackendInUseError, TorchBackend
from kestrel_rt.kv_cache import ContextFullError
from kestrel_rt.model import Qwen3Model

TOL = 1e-5


@pytest.fixture(scope="module", params=["untied", "moe_norm"])
def folder(request, tmp_path_factory):
    return tm.build(request.param, tmp_path_factory.mktemp(request.param))


def _model(folder, slots: int = 4, max_len: int = 64) -> Qwen3Model:
    shape, weights = tm.read(folder)
    model = Qwen3Model(shape, weights, TorchBackend("cpu", torch.float32))
    model.allocate_kv(slots, max_len)
    return model


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _greedy_alone(model: Qwen3Model, prompt: list[int], steps: int):
    """Prefill one prompt then greedy-decode `steps` tokens: (logits per step, tokens)."""
    slot = model.kv.allocate()
    logits = [model.prefill([prompt], [slot])[0]]  # each [V]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits.append(model.forward(torch.tensor([[tokens[-1]]]), [slot])[0, 0])
        tokens.append(int(logits[-1].argmax()))
    model.kv.free(slot)
    return logits, tokens


def test_batch_of_different_lengths_decodes_as_each_alone(folder):
    model = _model(folder)
    lengths, steps = [3, 9, 1, 6], 12
    prompts = _prompts(model.shape.vocab_size, lengths)
    alone = [_greedy_alone(model, p, steps) for p in prompts]

    slots = [model.kv.allocate() for _ in prompts]
    logits = model.prefill(prompts, slots)  # [4, V], one padded batch
    tokens = [[int(t)] for t in logits.argmax(-1)]
    batch_logits = [[row] for row in logits]
    for _ in range(steps):
        last = torch.tensor([[t[-1]] for t in tokens])  # [4, 1]
        logits = model.forward(last, slots)[:, 0]  # [4, V]
        for b, row in enumerate(logits):
            batch_logits[b].append(row)
            tokens[b].append(int(row.argmax()))
    for b, (ref_logits, ref_tokens) in enumerate(alone):
        assert tokens[b] == ref_tokens
        diff = max((x - y).abs().max().item() for x, y in zip(batch_logits[b], ref_logits))
        assert diff <= TOL, f"sequence {b} (prompt {lengths[b]}): {diff}"
        assert model.kv.length(slots[b]) == lengths[b] + steps


def test_ragged_prefill_padding_does_not_leak(folder):
    """Every position of a padded prefill row equals the same prompt run alone."""
    model = _model(folder)
    prompts = _prompts(model.shape.vocab_size, [2, 7, 5], seed=3)
    alone = []
    for p in prompts:
        s = model.kv.allocate()
        alone.append(model.forward(torch.tensor([p]), [s])[0])  # [n, V]
        model.kv.free(s)
    slots = [model.kv.allocate() for _ in prompts]
    padded = torch.zeros(3, 7, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = torch.tensor(p)
    logits = model.forward(padded, slots, n_new=[len(p) for p in prompts])  # [3, 7, V]
    for b, p in enumerate(prompts):
        assert (logits[b, : len(p)] - alone[b]).abs().max().item() <= TOL
        assert model.kv.length(slots[b]) == len(p)


def test_rollback_then_redecode_gives_identical_logits(folder):
    model = _model(folder)
    prompt = _prompts(model.shape.vocab_size, [5], seed=4)[0]
    slot = model.kv.allocate()
    model.prefill([prompt], [slot])
    base = model.kv.length(slot)
    k = 4
    draft = torch.tensor([[7, 3, 11, 2]])  # [1, k]
    first = [model.forward(draft[:, i : i + 1], [slot])[0, 0] for i in range(k)]
    model.kv.rollback(slot, base)
    assert model.kv.length(slot) == base
    again = [model.forward(draft[:, i : i + 1], [slot])[0, 0] for i in range(k)]
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    # a verify-shaped forward (k tokens at once) after rollback gives the same logits
    model.kv.rollback(slot, base)
    verify = model.forward(draft, [slot])[0]  # [k, V]
    assert (verify - torch.stack(first)).abs().max().item() <= TOL
    # partial rollback: keep 2 of the k tokens, re-decode the third
    model.kv.rollback(slot, base + 2)
    third = model.forward(draft[:, 2:3], [slot])[0, 0]
    assert (third - first[2]).abs().max().item() <= TOL


def test_verify_batch_over_sequences_of_different_lengths(folder):
    """M = k + 1 new tokens per sequence against caches of different lengths."""
    model = _model(folder)
    prompts = _prompts(model.shape.vocab_size, [4, 10], seed=5)
    slots = [model.kv.allocate() for _ in prompts]
    model.prefill(prompts, slots)
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])  # [2, 3]
    together = model.forward(drafts, slots)  # [2, 3, V]
    for b, p in enumerate(prompts):
        s = model.kv.allocate()
        model.prefill([p], [s])
        alone = model.forward(drafts[b : b + 1], [s])[0]
        assert (together[b] - alone).abs().max().item() <= TOL
        model.kv.free(s)


def test_context_full_is_an_error_not_a_silent_overwrite(folder):
    model = _model(folder, slots=1, max_len=8)
    slot = model.kv.allocate()
    model.forward(torch.zeros(1, 6, dtype=torch.long), [slot])
    with pytest.raises(ContextFullError, match="max_len 8"):
        model.forward(torch.zeros(1, 3, dtype=torch.long), [slot])
    assert model.kv.length(slot) == 6


def test_two_models_in_two_backends_give_what_each_gives_alone(tmp_path):
    small = tm.build("tied", tmp_path / "small", seed=1)
    big = tm.build("moe_norm", tmp_path / "big", seed=2)
    prompt = [5, 1, 4, 1, 5, 9, 2, 6]

    def run(model: Qwen3Model) -> torch.Tensor:
        s = model.kv.allocate()
        out = model.forward(torch.tensor([prompt]), [s])
        model.kv.free(s)
        return out

    alone_small, alone_big = run(_model(small)), run(_model(big))
    a, b = _model(small), _model(big)
    assert a.model_id != b.model_id
    assert all(k.startswith(a.model_id + "/") for k in a.backend.weight_names())
    # interleave: each forward of one model runs between forwards of the other
    for _ in range(2):
        assert torch.equal(run(a), alone_small)
        assert torch.equal(run(b), alone_big)


def test_a_backend_refuses_a_second_model(tmp_path):
    folder = tm.build("tied", tmp_path / "m")
    backend = TorchBackend("cpu", torch.float32)
    Qwen3Model(*tm.read(folder), backend)
    with pytest.raises(BackendInUseError, match="own backend"):
        Qwen3Model(*tm.read(folder), backend)


def test_static_step_reads_the_whole_cache_and_gives_the_same_logits(folder):
    """kv.step(static=True) (CUDA-graph shapes: keys up to max_len) changes nothing."""
    model = _model(folder, slots=2, max_len=32)
    prompts = _prompts(model.shape.vocab_size, [3, 6], seed=6)
    slots = [model.kv.allocate() for _ in prompts]
    model.prefill(prompts, slots)
    tokens = torch.tensor([[4, 8], [15, 16]])  # [2, 2]
    dynamic = model.kv.step(slots, 2, [2, 2])
    static = model.kv.step(slots, 2, [2, 2], static=True)
    assert dynamic.max_ctx == 8 and static.max_ctx == 32
    a = model.compute(tokens, dynamic)
    b = model.compute(tokens, static)  # rewrites the same K/V, lengths untouched
    assert (a - b).abs().max().item() <= TOL
    assert model.kv.lengths[slots[0]] == 3
