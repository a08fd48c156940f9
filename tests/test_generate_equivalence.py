"""kestrel_rt.engine.generate against transformers' generate, and sampling's contract."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from kestrel_rt.backend import TorchBackend
from kestrel_rt.engine import PromptTooLongError, generate
from kestrel_rt.loading import load_folder
from kestrel_rt.model import Qwen3Model
from kestrel_rt.sampling import probabilities, sample_from
from kestrel_sim.errors import KestrelError

NEW = 20


@pytest.fixture(scope="module", params=sorted(tm.CONFIGS))
def folder(request, tmp_path_factory):
    return tm.build(request.param, tmp_path_factory.mktemp(request.param))


def _model(folder) -> Qwen3Model:
    shape, weights = load_folder(folder, "cpu", "float32")
    return Qwen3Model(shape, weights, TorchBackend("cpu", torch.float32))


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_token_for_token(folder):
    ref, model = tm.reference(folder), _model(folder)
    prompts = _prompts(model.shape.vocab_size, [5, 12, 1])
    # max_batch=2: the third prompt waits for a free slot (continuous batching)
    result = generate(model, prompts, max_new_tokens=NEW, max_batch=2)
    for p, got in zip(prompts, result.token_ids):
        assert got == _hf_greedy(ref, p, NEW)
    assert result.generated_tokens == 3 * NEW
    assert result.prompt_tokens == 18
    assert result.tokens_per_s > 0 and result.decode_steps >= NEW - 1


def test_eos_stops_only_its_sequence(tmp_path):
    folder = tm.build("untied", tmp_path / "m")
    model = _model(folder)
    prompts = _prompts(model.shape.vocab_size, [4, 7])
    free = generate(model, prompts, max_new_tokens=NEW).token_ids
    eos = free[0][3]
    stop0 = free[0].index(eos) + 1
    result = generate(model, prompts, max_new_tokens=NEW, eos_token_id=eos)
    assert result.token_ids[0] == free[0][:stop0]
    stop1 = free[1].index(eos) + 1 if eos in free[1] else NEW
    assert result.token_ids[1] == free[1][:stop1]


def test_sampling_is_deterministic_for_a_seed_and_independent_of_batching(tmp_path):
    folder = tm.build("moe", tmp_path / "m")
    model = _model(folder)
    prompts = _prompts(model.shape.vocab_size, [3, 8, 5])
    kw = {"max_new_tokens": NEW, "temperature": 0.9, "top_p": 0.95}
    a = generate(model, prompts, seed=123, **kw).token_ids
    b = generate(model, prompts, seed=123, **kw).token_ids
    c = generate(model, prompts, seed=124, **kw).token_ids
    assert a == b
    assert a != c
    # request i samples with seed + i, alone or batched
    for i, p in enumerate(prompts):
        assert generate(model, [p], seed=123 + i, **kw).token_ids[0] == a[i]
    # a nucleus this small keeps only the most likely token: greedy
    greedy = generate(model, prompts, max_new_tokens=NEW).token_ids
    assert generate(model, prompts, max_new_tokens=NEW, temperature=1.0, top_p=1e-9,
                    seed=5).token_ids == greedy


def test_top_p_keeps_what_transformers_keeps():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_p in [(1.0, 0.9), (0.7, 0.5), (1.3, 0.99)]:
        ours = probabilities(logits, temperature, top_p)
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        scores = TopPLogitsWarper(top_p)(None, scores)
        theirs = torch.softmax(scores, dim=-1)
        assert torch.equal(ours > 0, theirs > 0)
        assert (ours - theirs).abs().max().item() <= 1e-6


def test_inverse_cdf_sampling_follows_the_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.15, 0.05]])
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    draws = sample_from(probs.expand(n, -1), u)
    freq = torch.bincount(draws, minlength=5).float() / n
    assert freq[1] == 0
    assert (freq - probs[0]).abs().max().item() < 0.015


def test_bad_prompts_are_user_errors(tmp_path):
    model = _model(tm.build("tied", tmp_path / "m"))
    ctx = model.shape.max_position_embeddings
    with pytest.raises(PromptTooLongError, match=f"context of {ctx}"):
        generate(model, [[1] * ctx], max_new_tokens=1)
    assert generate(model, [[1, 2]], max_new_tokens=0).token_ids == [[]]


def test_generation_stops_when_the_context_is_full(tmp_path):
    """Prompt plus generated tokens never exceed max_position_embeddings (as transformers'
    max_length and vLLM's max_model_len count them); other sequences run on."""
    folder = tm.build("tied", tmp_path / "m")
    ref, model = tm.reference(folder), _model(folder)
    ctx = model.shape.max_position_embeddings
    long, last, short = _prompts(model.shape.vocab_size, [ctx - 5, ctx - 1, 3])
    result = generate(model, [long, last, short], max_new_tokens=NEW)
    assert [len(t) for t in result.token_ids] == [5, 1, NEW]
    assert result.token_ids[0] == _hf_greedy(ref, long, 5)
    assert result.token_ids[2] == _hf_greedy(ref, short, NEW)


@pytest.mark.parametrize("kw, words", [
    ({"temperature": -0.5}, "temperature is -0.5"),
    ({"temperature": float("nan")}, "temperature is nan"),
    ({"temperature": float("inf")}, "temperature is inf"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p is 0.0"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p is 1.5"),
    ({"temperature": 1.0, "seed": -1}, "seed -1"),
    ({"temperature": 1.0, "seed": 2**64}, "seed 18446744073709551616"),
    ({"max_batch": 0}, "max_batch is 0"),
])
def test_bad_sampling_settings_are_user_errors(tmp_path, kw, words):
    model = _model(tm.build("tied", tmp_path / "m"))
    with pytest.raises(KestrelError, match=words):
        generate(model, [[1, 2]], max_new_tokens=2, **kw)


def test_the_largest_seed_wraps_for_the_next_request(tmp_path):
    model = _model(tm.build("moe", tmp_path / "m"))
    prompts = _prompts(model.shape.vocab_size, [3, 4])
    kw = {"max_new_tokens": 6, "temperature": 1.0}
    both = generate(model, prompts, seed=2**64 - 1, **kw).token_ids
    assert both[1] == generate(model, [prompts[1]], seed=0, **kw).token_ids[0]


# Half-precision checkpoints run in their own dtype (config.json's), as transformers runs them.
# One sequence's logits measured bitwise equal to transformers' on the CPU (torch 2.13,
# transformers 5.24); the bounds leave room for another summation order (a few bf16 / fp16
# steps at |logit| ~2). In half precision a batch's rounding depends on its composition (as in
# any engine), so each prompt runs alone here; fp32 batches are exact (test_batching.py).
HALF_TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["untied", "moe_norm"])
def test_half_precision_checkpoints_match_transformers_in_their_dtype(tmp_path, name, dtype):
    tm.in_memory(name).to(dtype).save_pretrained(tmp_path, max_shard_size="20KB")
    shape, weights = load_folder(tmp_path, "cpu")  # the dtype config.json declares
    assert {w.dtype for w in weights.values()} == {dtype}
    model = Qwen3Model(shape, weights, TorchBackend("cpu", dtype))
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()  # fp32 RoPE buffers
    prompts = _prompts(shape.vocab_size, [9, 4])
    model.allocate_kv(1, 16)
    ours = model.forward(torch.tensor([prompts[0]]), [model.kv.allocate()])[0]  # [9, V]
    with torch.no_grad():
        theirs = ref(torch.tensor([prompts[0]])).logits.float()[0]  # [9, V]
    assert (ours - theirs).abs().max().item() <= HALF_TOL[dtype]
    for p in prompts:
        assert generate(model, [p], max_new_tokens=NEW).token_ids[0] == _hf_greedy(ref, p, NEW)


@pytest.mark.parametrize("max_batch", [None, 2])
def test_overlapped_loop_gives_the_same_tokens(tmp_path, max_batch):
    """The overlapped greedy loop (step n + 1 enqueued before step n's tokens are read; the
    GPU default) stops, batches and fills the context exactly as the plain one: EOS seen one
    step late, a waiting prompt, a prompt that fills the context."""
    folder = tm.build("untied", tmp_path / "m")
    model = _model(folder)
    ctx = model.shape.max_position_embeddings
    prompts = _prompts(model.shape.vocab_size, [4, 7, ctx - 3, 2])
    free = generate(model, prompts, max_new_tokens=NEW, overlap=False).token_ids
    eos = free[1][4]
    forward, rows = model.forward, []

    def counted(tokens, slots, *args, **kwargs):  # decode rows forwarded (prompts are > 1)
        if tokens.shape[1] == 1:
            rows.append(tokens.shape[0])
        return forward(tokens, slots, *args, **kwargs)

    model.forward = counted
    runs = []
    for o in (False, True):
        rows.clear()
        runs.append((generate(model, prompts, max_new_tokens=NEW, eos_token_id=eos,
                              max_batch=max_batch, overlap=o), sum(rows)))
    model.forward = forward
    (plain, plain_rows), (lagged, lagged_rows) = runs
    assert lagged.token_ids == plain.token_ids
    assert len(lagged.token_ids[1]) <= 5  # the EOS stopped it
    assert len(lagged.token_ids[2]) == 3  # the context did
    # only a sequence stopped by an EOS (seen one step late) costs one extra row
    eos_stops = sum(1 for t in lagged.token_ids if t and t[-1] == eos)
    assert plain_rows <= lagged_rows <= plain_rows + eos_stops
    assert generate(model, prompts, max_new_tokens=NEW, max_batch=max_batch,
                    overlap=True).token_ids == free


def test_overlap_needs_greedy(tmp_path):
    model = _model(tm.build("tied", tmp_path / "m"))
    with pytest.raises(KestrelError, match="overlap=True needs greedy"):
        generate(model, [[1, 2]], max_new_tokens=2, temperature=0.5, overlap=True)
