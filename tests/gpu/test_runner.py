"""kestrel_rt/runner.py on the GPU: a model from a Hugging Face folder built by build_model
with this device's default options (the cupy backend, CUDA graphs; on sm_90+ PDL and the
bulk gemv; norms folded where that helps) and made ready by prepare (KV cache, kernels,
decode graphs) is as accurate as the tests of the hand-built backends ask
(test_cupy_backend.py), and greedy generation on it gives the torch reference's tokens.
"""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

import gpu_models as gm
import tiny_models as tm

from kestrel_rt.backend import TorchBackend
from kestrel_rt.backend.cupy_backend import CupyBackend
from kestrel_rt.cuda.graphs import GraphModel
from kestrel_rt.engine import generate
from kestrel_rt.options import default_options, fold_helps
from kestrel_rt.runner import build_model, prepare

LENGTHS = [5, 9, 3, 20]  # 20 > 16: prefill through the torch attention fallback
# gpu_models' wide (dense) and wide_moe with 4 experts, every one chosen: its output is
# continuous in its inputs (no routing flip turns bf16 noise into another expert; with top 2
# of 8, folding's rounding of the router flips a token now and then, which costs its logits
# ~0.15 relative error), so the bar holds for every logits tensor
CONFIGS = {"wide": gm.WIDE["wide"],
           "moe_all": dict(gm.WIDE["wide_moe"], num_experts=4, num_experts_per_tok=4)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Folders of CONFIGS' models (fp32), written by transformers."""
    made = {}
    for name, cfg in CONFIGS.items():
        made[name] = tmp_path_factory.mktemp(name)
        tm.from_config(cfg).save_pretrained(made[name])
    return made


def _torch(folder, dtype: str):
    """The folder on the torch reference backend (CUDA) in `dtype`, with 4 slots."""
    m = build_model(folder, "cuda", dtype, options=default_options("cuda", backend="torch"))
    assert type(m.backend) is TorchBackend and not isinstance(m, GraphModel)
    m.allocate_kv(4, 128)
    return m


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_built_bf16_model_as_accurate_as_torch_bf16(folders, name):
    """build_model + prepare with the defaults, bf16: a GraphModel on the cupy backend whose
    norms are folded where fold_helps says so, its decode graphs captured by prepare; its
    logits (prefill, decode and verify replays) as close to fp32 as the torch backend's in
    bf16 (test_cupy_backend.py's bar)."""
    folder = folders[name]
    exact = gm.run_script(_torch(folder, "float32"), LENGTHS, 6)
    ref = gm.run_script(_torch(folder, "bfloat16"), LENGTHS, 6)
    model = build_model(folder, "cuda", "bfloat16")
    be = model.backend
    assert isinstance(model, GraphModel) and isinstance(be, CupyBackend)
    assert be.options == default_options("cuda", model.shape, None)
    folded = fold_helps(model.shape, None, be.options.bulk_gemv)
    assert be.options.fold_norms == folded and be.is_unit_norm("norm") == folded
    prepare(model, 4, 128, batches=(4,), new_tokens=(1,))
    assert (4, 1, False, True, 128) in model.graphs  # the greedy decode graph, captured now
    got = gm.run_script(model, LENGTHS, 6)
    assert model.replays > 0
    errs = [(gm.rel_err(g, e), gm.rel_err(r, e)) for g, r, e in zip(got, ref, exact, strict=True)]
    assert all(g <= 1.5 * r + 1e-3 for g, r in errs), errs


def test_built_fp32_model_generates_the_reference_tokens(folders):
    """build_model + prepare with the defaults in fp32 (the cupy backend's fp32 kernels, norms
    folded where fold_helps says so): greedy generation, which replays the decode graph that
    prepare captured, gives the torch fp32 backend's tokens."""
    folder = folders["wide"]
    ref = _torch(folder, "float32")
    prompts = gm.prompts(ref.shape.vocab_size, [6, 11, 2], seed=9)
    want = generate(ref, prompts, max_new_tokens=12).token_ids
    model = build_model(folder, "cuda", "float32")
    assert isinstance(model, GraphModel) and model.backend.dtype == torch.float32
    prepare(model, 3, 64, batches=(3,), new_tokens=(1,))
    captured = set(model.graphs)
    assert (4, 1, False, True, 64) in captured  # batch 3: bucket 4
    got = generate(model, prompts, max_new_tokens=12)
    assert got.token_ids == want
    assert model.replays > 0 and set(model.graphs) >= captured
