"""The cupy backend against the torch backend on the GPU, and per-model isolation.

Logits of tiny Qwen3 / Qwen3-MoE models (ragged prefill, decode, a verify-shaped forward,
rollback) on CupyBackend vs TorchBackend on the same GPU: relative error <= 1e-5 in fp32; in
bf16 the cupy backend's error against fp32 is at most 1.5x the torch backend's (+1e-3). A draft and a target of different sizes loaded side by side each give
exactly what each gives alone, also with the draft on the CPU torch backend.
"""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

import gpu_models as gm

from kestrel_rt.backend import BackendInUseError, TorchBackend
from kestrel_rt.backend.cupy_backend import CupyBackend
from kestrel_rt.cuda import reference
from kestrel_rt.model import Qwen3Model

NAMES = ["tied", "untied", "odd_head_dim", "sharded", "moe", "moe_norm", "wide", "wide128",
         "wide_moe"]
LENGTHS = [5, 9, 3, 20]  # 20 > 16: prefill through the torch attention fallback


@pytest.mark.parametrize("name", NAMES)
def test_fp32_logits_match_torch_backend(name):
    ref = gm.run_script(gm.model(name, TorchBackend("cuda", torch.float32)), LENGTHS, 6)
    got = gm.run_script(gm.model(name, CupyBackend("cuda", torch.float32)), LENGTHS, 6)
    assert len(ref) == len(got)
    errs = [gm.rel_err(g, r) for g, r in zip(got, ref)]
    assert max(errs) <= 1e-5, errs


@pytest.mark.parametrize("name", NAMES)
def test_bf16_logits_as_accurate_as_torch_bf16(name):
    """Over a whole model two bf16 computations drift apart by about bf16's own error (1-2%
    here, measured on the H200), so the bar is the fp32 result: the cupy backend in bf16 must
    be about as close to it as the torch backend in bf16 is."""
    exact = gm.run_script(gm.model(name, TorchBackend("cuda", torch.float32)), LENGTHS, 6)
    ref = gm.run_script(gm.model(name, TorchBackend("cuda", torch.bfloat16)), LENGTHS, 6)
    got = gm.run_script(gm.model(name, CupyBackend("cuda", torch.bfloat16)), LENGTHS, 6)
    for g, r, e in zip(got, ref, exact):
        err_cupy, err_torch = gm.rel_err(g, e), gm.rel_err(r, e)
        assert err_cupy <= 1.5 * err_torch + 1e-3, (err_cupy, err_torch)
        assert gm.rel_err(g, r) <= 3e-2


def test_ops_fall_back_for_fp16():
    ref = gm.run_script(gm.model("untied", TorchBackend("cuda", torch.float16)), [4, 6], 3)
    got = gm.run_script(gm.model("untied", CupyBackend("cuda", torch.float16)), [4, 6], 3)
    assert max(gm.rel_err(g, r) for g, r in zip(got, ref)) == 0.0


def test_backend_refuses_a_second_model():
    be = CupyBackend("cuda", torch.float32)
    gm.model("tied", be)
    with pytest.raises(BackendInUseError):
        gm.model("untied", be)


def _interleaved(draft, target, steps: int):
    """Prefill and decode both models in alternation: (draft logits, target logits)."""
    ds, ts = draft.kv.allocate(), target.kv.allocate()
    prompt = gm.prompts(draft.shape.vocab_size, [7], seed=5)
    d = [draft.prefill(prompt, [ds]).cpu()]
    t = [target.prefill(prompt, [ts]).cpu()]
    for _ in range(steps):
        d.append(draft.forward(d[-1].argmax(-1)[:, None].to(draft.device), [ds])[:, 0].cpu())
        t.append(target.forward(t[-1].argmax(-1)[:, None].to(target.device), [ts])[:, 0].cpu())
    return d, t


def _alone(m, steps: int):
    s = m.kv.allocate()
    prompt = gm.prompts(m.shape.vocab_size, [7], seed=5)
    out = [m.prefill(prompt, [s]).cpu()]
    for _ in range(steps):
        out.append(m.forward(out[-1].argmax(-1)[:, None].to(m.device), [s])[:, 0].cpu())
    return out


@pytest.mark.parametrize("draft_device", ["cuda", "cpu"])
def test_draft_and_target_side_by_side(draft_device):
    """Draft 'tied' (2 layers) and target 'untied' (3 layers) share layer names such as
    layers.0.qkv; with one backend per model, neither sees the other's weights."""
    def draft_backend():
        if draft_device == "cpu":
            return TorchBackend("cpu", torch.float32)
        return CupyBackend("cuda", torch.float32)

    draft_alone = _alone(gm.model("tied", draft_backend(), seed=1), 5)
    target_alone = _alone(gm.model("untied", CupyBackend("cuda", torch.float32), seed=2), 5)
    draft = gm.model("tied", draft_backend(), seed=1)
    target = gm.model("untied", CupyBackend("cuda", torch.float32), seed=2)
    assert not set(draft.backend.weight_names()) & set(target.backend.weight_names())
    if draft_device == "cuda":
        assert draft.backend.kernels is not target.backend.kernels
    d, t = _interleaved(draft, target, 5)
    for a, b in zip(d, draft_alone):
        assert torch.equal(a, b)
    for a, b in zip(t, target_alone):
        assert torch.equal(a, b)


def test_speculative_greedy_cpu_draft_gpu_target_equals_plain_greedy():
    """k=3 speculation with the draft on the CPU and the target on the GPU, acceptance by the
    greedy_accept kernel: the output equals the target's own greedy decode."""
    k, n_tokens = 3, 12
    target_alone = gm.model("untied", CupyBackend("cuda", torch.float32), seed=2)
    plain = [int(x.argmax()) for x in _alone(target_alone, n_tokens)]

    draft = gm.model("tied", TorchBackend("cpu", torch.float32), seed=1)
    target = gm.model("untied", CupyBackend("cuda", torch.float32), seed=2)
    ds, ts = draft.kv.allocate(), target.kv.allocate()
    prompt = gm.prompts(draft.shape.vocab_size, [7], seed=5)
    draft.prefill(prompt, [ds])
    out = [int(target.prefill(prompt, [ts]).argmax())]
    accepted_total = 0
    while len(out) < n_tokens + 1:
        base_d, base_t = draft.kv.length(ds), target.kv.length(ts)
        proposal, last = [], out[-1]
        for _ in range(k):
            last = int(draft.forward(torch.tensor([[last]]), [ds])[0, 0].argmax())
            proposal.append(last)
        block = torch.tensor([[out[-1]] + proposal], device="cuda")  # [1, k+1]
        verify = target.forward(block, [ts])  # [1, k+1, V]
        acc, nxt = target.backend.greedy_accept(
            torch.tensor([proposal], device="cuda"), verify.argmax(-1))
        ref_acc, ref_nxt = reference.greedy_accept(torch.tensor([proposal]),
                                                   verify.argmax(-1).cpu())
        assert int(acc) == int(ref_acc) and int(nxt) == int(ref_nxt)
        n = int(acc)
        accepted_total += n
        out += proposal[:n] + [int(nxt)]
        target.kv.rollback(ts, base_t + 1 + n)  # keep the last token + the accepted ones
        if n == k:  # the draft never saw its own last proposal: feed it
            draft.forward(torch.tensor([[proposal[-1]]]), [ds])
        else:
            draft.kv.rollback(ds, base_d + 1 + n)
    assert out[: n_tokens + 1] == plain


@pytest.mark.parametrize("fuse", [False, True], ids=["norm-kernel", "norm-prologue"])
def test_glu_epilogue_and_prologues_as_accurate(fuse):
    """The optional fusions (SwiGLU in the gate_up gemv's epilogue, RMSNorm in the gemvs'
    prologue) keep a bf16 model as close to fp32 as the default kernels are."""
    exact = gm.run_script(gm.model("wide", TorchBackend("cuda", torch.float32)), LENGTHS, 6)
    plain = CupyBackend("cuda", torch.bfloat16)
    plain.glu_epilogue = False
    ref = gm.run_script(gm.model("wide", plain), LENGTHS, 6)
    be = CupyBackend("cuda", torch.bfloat16)
    be.glu_epilogue, be.fuse_prologues = True, fuse
    got = gm.run_script(gm.model("wide", be), LENGTHS, 6)
    for g, r, e in zip(got, ref, exact):
        assert gm.rel_err(g, e) <= 1.5 * gm.rel_err(r, e) + 1e-3


def test_bulk_settings_by_kind_give_the_same_logits():
    """CupyBackend.kind_bulk: the o projections' (and others') launches take that bulk variant
    (a deeper ring: the same WARPS and C, so the same sums in the same order): bitwise the same
    logits, one sequence (the bulk kernel's rows)."""
    outs, settings = [], []
    for kinds in ({}, {"o": (8, 6, 2048), "down": (8, 6, 2048)}):
        be = CupyBackend("cuda", torch.bfloat16)
        be.kind_bulk = kinds
        g = be.gemv()
        launch = g._launch_bulk
        g._launch_bulk = (lambda *a, launch=launch, **kw:
                          settings.append(kw.get("setting")) or launch(*a, **kw))
        outs.append(gm.run_script(gm.model("wide", be), [7], 4))
    assert {(8, 6, 2048), None} <= set(settings)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", ["all", "moe"])
@pytest.mark.parametrize("name", ["wide", "wide_moe"])
def test_folded_norms_as_row_scale_as_accurate(name, rows):
    """Norm weights folded into the next linears (kestrel_rt/fold.py) and applied as the bf16
    gemvs' (and moe_gate_up's) row scale (norm_row_scale): as close to the fp32 model as the
    default kernels. A MoE model's routing flips now and then between any two bf16 runs (one
    flipped token costs its logits ~0.15 relative error: the torch backend in bf16 against
    fp32 does that too), so there the median over the script's logits is compared."""
    from kestrel_rt.fold import fold_norms

    exact = gm.run_script(gm.model(name, TorchBackend("cuda", torch.float32)), LENGTHS, 6)
    ref = gm.run_script(gm.model(name, CupyBackend("cuda", torch.bfloat16)), LENGTHS, 6)
    shape, w = gm.weights(name)
    shape, w = fold_norms(shape, w, moe_only=rows == "moe")
    be = CupyBackend("cuda", torch.bfloat16)
    be.norm_row_scale = rows
    model = Qwen3Model(shape, w, be)
    model.allocate_kv(4, 128)
    moe = name == "wide_moe"
    assert ("layers.0.post_norm" in be._unit_norms) == (moe or rows == "all")
    assert ("norm" in be._unit_norms) == (rows == "all")
    got = gm.run_script(model, LENGTHS, 6)
    errs = [(gm.rel_err(g, e), gm.rel_err(r, e)) for g, r, e in zip(got, ref, exact)]
    if moe:
        med = [sorted(v)[len(v) // 2] for v in zip(*errs)]
        assert med[0] <= 1.5 * med[1] + 1e-3, errs
    else:
        assert all(g <= 1.5 * r + 1e-3 for g, r in errs), errs


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_folded_norms_from_producer_sums_as_accurate(graphs):
    """norm_row_scale "producer" on the dense "wide" model with every norm folded: the
    residual gemvs (o, down) write their outputs' sums of squares, and the gemv after each
    norm (gate_up, the next layer's qkv, lm_head) takes its rstd from them. As close to the
    fp32 model as the default kernels (test_folded_norms_as_row_scale_as_accurate's bar);
    every decode forward (B = 4 rows) takes 2 per layer that way (post_norm, then the next
    input norm or the final norm), prefill and verify (more rows than the bf16 gemv takes)
    none; with CUDA graphs (captured buffers, replayed) the same."""
    from kestrel_rt.cuda.graphs import GraphModel
    from kestrel_rt.fold import fold_norms

    exact = gm.run_script(gm.model("wide", TorchBackend("cuda", torch.float32)), LENGTHS, 6)
    ref = gm.run_script(gm.model("wide", CupyBackend("cuda", torch.bfloat16)), LENGTHS, 6)
    shape, w = fold_norms(*gm.weights("wide"))
    be = CupyBackend("cuda", torch.bfloat16)
    be.norm_row_scale = "producer"
    model = (GraphModel if graphs else Qwen3Model)(shape, w, be)
    model.allocate_kv(4, 128)
    got = gm.run_script(model, LENGTHS, 6)
    errs = [(gm.rel_err(g, e), gm.rel_err(r, e)) for g, r, e in zip(got, ref, exact)]
    assert all(g <= 1.5 * r + 1e-3 for g, r in errs), errs
    if not graphs:  # (a graph's replays run no Python)
        assert be.ssq_consumed == 7 * 2 * shape.num_hidden_layers  # 6 + 1 decode forwards
    assert set(be._ssq_bufs) >= {(4, shape.hidden_size)}




@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
@pytest.mark.parametrize("variant", ["moe-f32", "moe_norm-bf16", "wide_moe-bf16",
                                     "wide_moe-folded", "wide_moe-graphs"])
def test_moe_fused_route_gives_the_same_logits(variant, early, monkeypatch):
    """CupyBackend.moe_fused_route (the routing inside moe_gate_up, no moe_route launch): the
    same logits as off, bit for bit (the same routing code and expert kernels), with no
    moe_route call left; moe_early on (moe_down_route) and off. folded: the post-attention
    norms of the MoE layers folded, a row scale in the router gemv and moe_gate_up (row_eps);
    graphs: decode replays CUDA graphs."""
    from kestrel_rt.cuda import ops
    from kestrel_rt.cuda.graphs import GraphModel
    from kestrel_rt.fold import fold_norms

    name, how = variant.split("-")
    dtype = torch.float32 if how == "f32" else torch.bfloat16
    calls = {"moe_route": 0, "moe_experts_routed": 0}

    def counted(fn):
        def call(*a, **kw):
            calls[fn.__name__] += 1
            return fn(*a, **kw)
        return call

    for fn in calls:
        monkeypatch.setattr(ops, fn, counted(getattr(ops, fn)))

    def run(fused: bool):
        be = CupyBackend("cuda", dtype)
        be.moe_fused_route, be.moe_early = fused, early
        shape, w = gm.weights(name)
        if how == "folded":
            shape, w = fold_norms(shape, w, moe_only=True)
            be.norm_row_scale = "moe"
        model = (GraphModel if how == "graphs" else Qwen3Model)(shape, w, be)
        model.allocate_kv(4, 128)
        return gm.run_script(model, LENGTHS, 6)

    ref = run(False)
    assert calls["moe_route"] > 0 and calls["moe_experts_routed"] == 0
    calls.update(moe_route=0)
    got = run(True)
    assert calls["moe_route"] == 0 and calls["moe_experts_routed"] > 0
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
