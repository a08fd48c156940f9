"""Logits of kestrel_rt's Qwen3 forward against transformers, on tiny random checkpoints."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.loading import load_folder
from kestrel_rt.model import Qwen3Model

TOL = 1e-4
DECODE_STEPS = 32


@pytest.fixture(scope="module", params=sorted(tm.CONFIGS))
def checkpoint(request, tmp_path_factory):
    folder = tm.build(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder


def _ours(folder) -> Qwen3Model:
    """The folder through the runtime's own loader (config.json + safetensors)."""
    shape, weights = load_folder(folder, "cpu", "float32")
    return Qwen3Model(shape, weights, TorchBackend("cpu", torch.float32))


def test_checkpoint_has_the_configured_features(checkpoint):
    name, folder = checkpoint
    shape, weights = tm.read(folder)  # the files as they are, and transformers' config
    loaded_shape, loaded = load_folder(folder, "cpu", "float32")
    assert loaded_shape == shape.model_copy(update={"name": folder.name})
    assert set(loaded) == set(weights) - ({"lm_head.weight"} if shape.tie_word_embeddings else set())
    assert ("lm_head.weight" in weights) != shape.tie_word_embeddings
    if name == "sharded":
        assert (folder / "model.safetensors.index.json").exists()
        assert len(list(folder.glob("*.safetensors"))) > 1
    if name == "odd_head_dim":
        assert shape.head_dim * shape.num_attention_heads != shape.hidden_size
    if name in tm.MOE_CONFIGS:
        assert shape.is_moe and "model.layers.0.mlp.experts.0.gate_proj.weight" in weights


def test_prefill_logits_match_transformers(checkpoint):
    _, folder = checkpoint
    model, ref = _ours(folder), tm.reference(folder)
    prompts = torch.randint(0, model.shape.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    model.allocate_kv(2, 16)
    slots = [model.kv.allocate(), model.kv.allocate()]
    ours = model.forward(prompts, slots)  # [2, 11, V]
    with torch.no_grad():
        theirs = ref(prompts).logits.float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= TOL
    assert model.kv.lengths[slots[0]] == 11


def test_decode_logits_match_transformers_for_32_steps(checkpoint):
    """transformers' generate (its own KV cache) gives the logits of every decode step."""
    _, folder = checkpoint
    model, ref = _ours(folder), tm.reference(folder)
    prompt = torch.randint(0, model.shape.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = ref.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=DECODE_STEPS + 1, min_new_tokens=DECODE_STEPS + 1,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    their_tokens = out.sequences[0, prompt.shape[1]:].tolist()
    their_logits = torch.stack(out.logits, dim=1)[0].float()  # [steps + 1, V]

    model.allocate_kv(1, prompt.shape[1] + DECODE_STEPS + 1)
    slot = model.kv.allocate()
    first = model.forward(prompt, [slot], last_only=True)  # [1, V]
    assert (first[0] - their_logits[0]).abs().max().item() <= TOL
    worst = 0.0
    for step in range(DECODE_STEPS):
        # feed transformers' token so both sides see the same sequence
        tok = torch.tensor([[their_tokens[step]]])
        logits = model.forward(tok, [slot])[:, 0]  # [1, V]
        worst = max(worst, (logits[0] - their_logits[step + 1]).abs().max().item())
        assert logits.argmax(-1).item() == their_tokens[step + 1]
    assert worst <= TOL
    assert model.kv.lengths[slot] == prompt.shape[1] + DECODE_STEPS


def test_greedy_forward_is_the_argmax_of_the_logits(checkpoint):
    """forward(..., greedy=True) returns the token ids the logits' argmax chooses (every
    position, or each row's last real one with last_only) and advances the cache the same."""
    _, folder = checkpoint
    model = _ours(folder)
    g = torch.Generator().manual_seed(3)
    block = torch.randint(0, model.shape.vocab_size, (2, 5), generator=g)
    model.allocate_kv(2, 16)
    slots = [model.kv.allocate(), model.kv.allocate()]
    logits = model.forward(block, slots, n_new=[5, 3])  # [2, 5, V]
    for s in slots:
        model.kv.rollback(s, 0)
    chosen = model.forward(block, slots, n_new=[5, 3], greedy=True)  # [2, 5]
    assert chosen.dtype == torch.long and torch.equal(chosen, logits.argmax(-1))
    assert [model.kv.lengths[s] for s in slots] == [5, 3]
    for s in slots:
        model.kv.rollback(s, 0)
    last = model.forward(block, slots, n_new=[5, 3], last_only=True, greedy=True)  # [2]
    assert last.tolist() == [chosen[0, 4].item(), chosen[1, 2].item()]
