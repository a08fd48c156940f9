"""CUDA-graph replay equals eager execution, for decode and verify shapes per batch bucket."""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

import gpu_models as gm

from kestrel_rt.backend import TorchBackend
from kestrel_rt.backend.cupy_backend import CupyBackend
from kestrel_rt.cuda.graphs import GraphModel
from kestrel_rt.engine import generate

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def _keys(graphed) -> set:
    """(rows, new tokens, last_only, greedy) of every captured graph."""
    return {key[:4] for key in graphed.graphs}


def _pair(name: str, dtype: torch.dtype, slots: int = 8):
    eager = gm.model(name, CupyBackend("cuda", dtype), slots=slots)
    graphed = gm.model(name, CupyBackend("cuda", dtype), cls=GraphModel, slots=slots)
    return eager, graphed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["untied", "odd_head_dim", "moe_norm", "wide", "wide_moe"])
def test_replay_equals_eager(name, dtype):
    eager, graphed = _pair(name, dtype)
    # batch 3 (bucket 4) prefill of short prompts, decode, verify M=4, rollback, decode
    for _ in range(2):  # the second pass replays what the first captured
        ref = gm.run_script(eager, [5, 9, 3], 4)
        got = gm.run_script(graphed, [5, 9, 3], 4)
        errs = [gm.rel_err(g, r) for g, r in zip(got, ref)]
        assert max(errs) <= TOL[dtype], errs
    assert graphed.replays > 0
    assert {(4, 1, False, False), (4, 4, False, False), (4, 9, True, False)} <= _keys(graphed)


@pytest.mark.parametrize("batch", [1, 2, 5, 16])
@pytest.mark.parametrize("m", [1, 2, 9])
def test_buckets_and_verify_widths(batch, m):
    eager, graphed = _pair("untied", torch.float32, slots=16)
    slots = {}
    for model in (eager, graphed):
        slots[id(model)] = [model.kv.allocate() for _ in range(batch)]
        model.prefill(gm.prompts(model.shape.vocab_size, [4] * batch), slots[id(model)])
    g = torch.Generator().manual_seed(batch * 100 + m)
    for _ in range(3):  # capture, then two replays
        block = torch.randint(0, eager.shape.vocab_size, (batch, m), generator=g)
        a = eager.forward(block, slots[id(eager)])
        b = graphed.forward(block, slots[id(graphed)])
        assert gm.rel_err(b.cpu(), a.cpu()) <= TOL[torch.float32]
    assert graphed.replays >= 2
    bucket = next(x for x in graphed.buckets if x >= batch)
    assert (bucket, m, False, False) in _keys(graphed)


def _greedy_case(dtype: torch.dtype, batch: int, m: int, seed: int):
    """A graphed tiny model with `batch` prefilled slots and random tokens [batch, m] on the
    GPU: (model, slots, tokens)."""
    _, graphed = _pair("untied", dtype, slots=8)
    slots = [graphed.kv.allocate() for _ in range(batch)]
    graphed.prefill(gm.prompts(graphed.shape.vocab_size, [4] * batch), slots)
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, graphed.shape.vocab_size, (batch, m), generator=g).cuda()
    return graphed, slots, tok


def _logits_rolled_back(graphed, tok: torch.Tensor, slots: list[int], last_only: bool):
    """(the logits of a forward of tok, the slots' lengths before it), the cache rolled back
    to those lengths after it."""
    before = [graphed.kv.length(s) for s in slots]
    logits = graphed.forward(tok.clone(), slots, last_only=last_only)
    for s, n in zip(slots, before):
        graphed.kv.rollback(s, n)
    return logits, before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,m,last_only", [(1, 1, False), (3, 1, False), (2, 4, False),
                                               (2, 4, True)])
def test_greedy_replay_is_the_argmax_of_the_replayed_logits(dtype, batch, m, last_only):
    """forward(..., greedy=True) by replay chooses what the logits' argmax chooses; at M = 1
    its result is the graph's token input, so feeding it back copies nothing."""
    graphed, slots, tok = _greedy_case(dtype, batch, m, seed=batch * 10 + m)
    kv = graphed.kv
    for step in range(4):  # capture, then replays
        logits, before = _logits_rolled_back(graphed, tok, slots, last_only)
        chosen = graphed.forward(tok, slots, last_only=last_only, greedy=True)
        assert chosen.dtype == torch.long
        assert torch.equal(chosen, logits.argmax(-1)), step
        assert [kv.length(s) for s in slots] == [n + m for n in before]
        if m == 1 and not last_only:
            tok = chosen  # [B, 1]: the next step's input
    key = (next(b for b in graphed.buckets if b >= batch), m, last_only, True, kv.max_len)
    assert key in graphed.graphs and graphed.replays >= 6
    if m == 1 and not last_only:
        assert tok.data_ptr() == graphed.graphs[key].tokens.data_ptr()


def test_eager_fallback_for_prefill_and_large_batches():
    _, graphed = _pair("untied", torch.float32, slots=70)
    slots = [graphed.kv.allocate() for _ in range(66)]
    graphed.prefill(gm.prompts(graphed.shape.vocab_size, [20, 3] * 33), slots)  # M=20 > 16
    graphed.forward(torch.zeros(66, 1, dtype=torch.long), slots)  # 66 > largest bucket
    assert graphed.graphs == {} and graphed.replays == 0


def test_generate_with_graphs_equals_torch_backend():
    ref = gm.model("untied", TorchBackend("cuda", torch.float32))
    graphed = gm.model("untied", CupyBackend("cuda", torch.float32), cls=GraphModel)
    prompts = gm.prompts(ref.shape.vocab_size, [6, 11, 2], seed=9)
    a = generate(ref, prompts, max_new_tokens=12)
    b = generate(graphed, prompts, max_new_tokens=12)
    assert a.token_ids == b.token_ids
    assert graphed.replays > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,m,last_only", [(1, 1, False), (3, 1, False), (2, 3, False),
                                               (2, 3, True)])
def test_forward_greedy_ids_reach_the_host_by_replay(dtype, batch, m, last_only):
    """forward_greedy by replay: the argmax kernel writes the ids into pinned host memory,
    alternating halves, so a step's ids read after the next step was enqueued are its own
    (the overlapped loop); they equal the ids on the device and the logits' argmax."""
    graphed, slots, tok = _greedy_case(dtype, batch, m, seed=batch * 7 + m)
    pending, pending_ref = None, None
    for step in range(6):  # capture, then replays
        ref = _logits_rolled_back(graphed, tok, slots, last_only)[0].argmax(-1).tolist()
        chosen = graphed.forward_greedy(tok, slots, last_only=last_only)
        assert chosen.host.device.type == "cpu" and chosen.host.shape == chosen.tokens.shape
        if pending is not None:  # the previous step's ids, read with this one in flight
            assert pending.read() == pending_ref, step
        assert chosen.read() == chosen.tokens.tolist() == ref, step
        pending, pending_ref = chosen, ref
        if m == 1 and not last_only:
            tok = chosen.tokens
    key = (next(b for b in graphed.buckets if b >= batch), m, last_only, True,
           graphed.kv.max_len)
    assert graphed.graphs[key].host is not None and graphed.replays >= 10


@pytest.mark.parametrize("max_batch", [None, 2])
def test_overlapped_generate_with_graphs_stops_and_refills_as_the_plain_loop(max_batch):
    """The overlapped loop takes its tokens from the graph's argmax (greedy=True) and feeds
    them back (a subset of rows when one ends on an EOS): same tokens as the plain loop of
    the torch backend, with waiting prompts taking freed slots."""
    ref = gm.model("untied", TorchBackend("cuda", torch.float32))
    graphed = gm.model("untied", CupyBackend("cuda", torch.float32), cls=GraphModel)
    prompts = gm.prompts(ref.shape.vocab_size, [6, 11, 2, 5], seed=4)
    free = generate(ref, prompts, max_new_tokens=10, overlap=False).token_ids
    eos = free[1][3]
    a = generate(ref, prompts, max_new_tokens=10, eos_token_id=eos, max_batch=max_batch,
                 overlap=False)
    b = generate(graphed, prompts, max_new_tokens=10, eos_token_id=eos, max_batch=max_batch)
    assert a.token_ids == b.token_ids and len(b.token_ids[1]) <= 4
    assert any(k[3] for k in graphed.graphs) and graphed.replays > 0


def test_padding_rows_do_not_touch_other_slots():
    _, graphed = _pair("untied", torch.float32, slots=8)
    kv = graphed.kv
    slots = [kv.allocate() for _ in range(3)]
    graphed.prefill(gm.prompts(graphed.shape.vocab_size, [4, 4, 4]), slots)
    untouched = kv.k[:, [s for s in range(8) if s not in slots]].clone()
    for _ in range(3):
        graphed.forward(torch.ones(3, 1, dtype=torch.long), slots)  # bucket 4: one pad row
    assert torch.equal(kv.k[:, [s for s in range(8) if s not in slots]], untouched)


@pytest.mark.parametrize("max_batch", [None, 2])
def test_overlapped_decode_gives_the_same_tokens(max_batch):
    """generate's overlap (step n + 1 enqueued before step n's tokens are read) changes no
    token: with EOS stops read one step late, continuous batching and the context limit."""
    graphed = gm.model("untied", CupyBackend("cuda", torch.float32), cls=GraphModel)
    prompts = gm.prompts(graphed.shape.vocab_size, [6, 11, 2, 7, 3], seed=4)
    plain = generate(graphed, prompts, max_new_tokens=14, max_batch=max_batch, overlap=False)
    eos = plain.token_ids[1][5]  # a token one sequence does produce: an early stop
    runs = [generate(graphed, prompts, max_new_tokens=14, max_batch=max_batch,
                     eos_token_id=eos, overlap=o) for o in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids
    assert any(len(t) < 14 for t in runs[1].token_ids)  # the EOS did stop one
    assert generate(graphed, prompts, max_new_tokens=14, max_batch=max_batch,
                    overlap=True).token_ids == plain.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_replays_its_length_bucket(dtype):
    """A one-sequence prefill longer than max_m replays the graph of its length's bucket
    (tokens padded, attention over the next power of two of keys): the same greedy token and
    K/V as the eager prefill, for a whole prompt and for a second chunk after it; a chunk
    whose padded bucket would not fit the cache runs eagerly."""
    eager = gm.model("wide", CupyBackend("cuda", dtype), max_len=512)
    graphed = gm.model("wide", CupyBackend("cuda", dtype), cls=GraphModel, max_len=512)
    vocab = eager.shape.vocab_size
    for n, chunk in ((40, 25), (100, 60), (33, 200)):
        prompt = gm.prompts(vocab, [n + chunk], seed=n)[0]
        got = []
        for model in (eager, graphed):
            slot = model.kv.allocate()
            first = model.forward(torch.tensor([prompt[:n]]), [slot], last_only=True,
                                  greedy=True)  # [1]
            second = model.forward(torch.tensor([prompt[n:]]), [slot], last_only=True,
                                   greedy=True)
            got.append((first.cpu(), second.cpu(), model.kv.k[:, slot, :n + chunk].cpu()))
            assert model.kv.length(slot) == n + chunk
            model.kv.free(slot)
        (a1, a2, ak), (b1, b2, bk) = got
        assert torch.equal(a1, b1) and torch.equal(a2, b2)
        assert gm.rel_err(bk, ak) <= TOL[dtype]
    keys = _keys(graphed)
    assert (1, 64, True, True) in keys and (1, 128, True, True) in keys  # 40, 60 / 100
    slot = graphed.kv.allocate()
    graphed.forward(torch.zeros(1, 490, dtype=torch.long), [slot], last_only=True, greedy=True)
    before = set(graphed.graphs)
    graphed.forward(torch.zeros(1, 20, dtype=torch.long), [slot], last_only=True, greedy=True)
    assert set(graphed.graphs) == before  # 490 + a 32-token bucket > 512: eager


def test_prefill_graph_replays_again_with_other_tokens():
    eager = gm.model("wide", CupyBackend("cuda", torch.float32), max_len=256)
    graphed = gm.model("wide", CupyBackend("cuda", torch.float32), cls=GraphModel, max_len=256)
    for seed in range(3):  # capture, then two replays of the same bucket
        prompt = torch.tensor([gm.prompts(eager.shape.vocab_size, [50 + seed], seed=seed)[0]])
        outs = []
        for model in (eager, graphed):
            slot = model.kv.allocate()
            outs.append(model.forward(prompt, [slot], last_only=True).cpu())  # logits [1, V]
            model.kv.free(slot)
        assert gm.rel_err(outs[1], outs[0]) <= TOL[torch.float32]
    assert graphed.replays >= 2


@pytest.mark.parametrize("order", ["chunk graph first", "verify graph first"])
def test_greedy_ids_outlive_the_replay_of_another_graph(order):
    """A greedy replay's ids stay as they were while another graph of the same backend (one
    memory pool) replays: serving reads a verify's ids after the prompt chunks that ride
    along with it. On the H200 an output allocated in the later capture lay in the earlier
    graph's scratch, and the chunk's replay overwrote the verify's ids."""
    graphed = gm.model("wide", CupyBackend("cuda", torch.float32), cls=GraphModel, slots=4,
                       max_len=256)
    vocab = graphed.shape.vocab_size
    a, b, c = (graphed.kv.allocate() for _ in range(3))
    graphed.prefill(gm.prompts(vocab, [12, 15]), [a, b])
    g = torch.Generator().manual_seed(0)

    def verify():  # batch 2 x 5 tokens (k = 4), greedy ids [2, 5]; rolled back after
        ids = graphed.forward(torch.randint(0, vocab, (2, 5), generator=g), [a, b],
                              greedy=True)
        graphed.kv.rollback(a, 12)
        graphed.kv.rollback(b, 15)
        return ids

    def chunk():  # one 40-token prompt chunk (a prefill graph), its next token [1]
        ids = graphed.forward(torch.randint(0, vocab, (1, 40), generator=g), [c],
                              last_only=True, greedy=True)
        graphed.kv.rollback(c, 0)
        return ids

    first, second = (chunk, verify) if order == "chunk graph first" else (verify, chunk)
    for _ in range(2):  # capture both, then replay both
        first()
        second()
    for _ in range(3):
        ids = second()
        kept = ids.clone()
        first()
        torch.cuda.synchronize()
        assert torch.equal(ids, kept)
    assert graphed.replays >= 6
