"""`kestrel generate --quant / --backend / AWQ folders` on the CPU.

The CLI's greedy ids under --quant int8 / int4 equal a greedy run of the same quantized
weights built directly in Python; an AWQ folder written by write_awq_folder generates exactly
what --quant int4 gives on its (fp16) source folder; option combinations that cannot run are
one-paragraph errors (exit 2, no traceback).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_models as tm
from generate_cli import error_of, invoke

from kestrel_rt.awq_write import write_awq_folder
from kestrel_rt.backend import TorchBackend
from kestrel_rt.engine import generate as run_generate
from kestrel_rt.model import Qwen3Model
from kestrel_rt.quant_weights import Int4Weight, Int8Weight, quantize_weights

PROMPT = [5, 17, 3, 88, 41]
N_NEW = 8

# tiny_models' configs with every projection dimension a multiple of 128 (int4's group).
WIDE = {
    "wide": dict(tm.CONFIGS["untied"], hidden_size=128, head_dim=32, intermediate_size=256),
    "wide_moe": dict(tm.CONFIGS["moe"], hidden_size=128, head_dim=32, intermediate_size=256,
                     moe_intermediate_size=128, num_experts=4),
}


def build_wide(name: str, folder, half: bool = False):
    """Write tiny checkpoint WIDE[name] (fp32, or fp16 with half) into `folder`."""
    model = tm.from_config(WIDE[name])
    (model.half() if half else model).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {name: tm.build(name, tmp_path_factory.mktemp(name)) for name in ("tied", "moe")}
    for name in WIDE:
        made[name] = build_wide(name, tmp_path_factory.mktemp(name))
    made["wide_moe16"] = build_wide("wide_moe", tmp_path_factory.mktemp("wide_moe16"), half=True)
    made["awq"] = write_awq_folder(made["wide_moe16"], tmp_path_factory.mktemp("awq"))
    return made


def run_json(folder, *args: str) -> dict:
    result = invoke("--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
                    "--max-new-tokens", str(N_NEW), "--json", "--ignore-eos", *args)
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def python_greedy(weights: dict, shape) -> list[int]:
    model = Qwen3Model(shape, weights, TorchBackend("cpu", torch.float32))
    return run_generate(model, [PROMPT], N_NEW).token_ids[0]


@pytest.mark.parametrize("mode, name", [("int8", "tied"), ("int8", "moe"), ("int4", "wide"),
                                        ("int4", "wide_moe")])
def test_quant_ids_equal_python_greedy_of_the_same_weights(folders, mode, name):
    report = run_json(folders[name], "--quant", mode, "--device", "cpu")
    assert (report["backend"], report["quant"], report["graphs"], report["awq"]) == (
        "torch", mode, False, False)
    assert report["dtype"] == "float32" and len(report["token_ids"]) == N_NEW
    shape, weights = tm.read(folders[name])
    weights = quantize_weights(weights, mode)
    cls = Int8Weight if mode == "int8" else Int4Weight
    expert = [n for n in weights if ".experts." in n]
    assert all(isinstance(weights[n], cls) for n in expert)  # MoE experts quantized too
    assert report["token_ids"] == python_greedy(weights, shape)


def test_quantization_changes_the_computation(folders):
    """The quantized runs are not the float run relabelled: int4's logits differ enough on
    this model that some greedy id changes (int4 rms weight error is ~10%, test_quant_model)."""
    plain = run_json(folders["wide_moe"], "--device", "cpu")
    int4 = run_json(folders["wide_moe"], "--quant", "int4", "--device", "cpu")
    assert plain["quant"] == "none" and plain["token_ids"] != int4["token_ids"]


def test_awq_folder_equals_quant_int4_on_its_source(folders):
    """write_awq_folder quantizes the fp16 source in fp32 with the same quantize_awq that
    --quant int4 uses and stores the other tensors in fp16 (exact for an fp16 source), so
    in fp32 both runs compute the same thing and must give the same ids."""
    awq = run_json(folders["awq"], "--device", "cpu")
    assert (awq["quant"], awq["awq"], awq["dtype"]) == ("int4", True, "float32")
    at_load = run_json(folders["wide_moe16"], "--quant", "int4", "--dtype", "float32")
    assert awq["token_ids"] == at_load["token_ids"]
    assert run_json(folders["awq"], "--quant", "int4")["token_ids"] == awq["token_ids"]


def test_bad_combinations_are_one_paragraph_errors(folders):
    base = ("--prompt-ids", "1,2,3", "--max-new-tokens", "2")
    awq_int8 = error_of(invoke("--model", str(folders["awq"]), *base, "--quant", "int8"))
    assert "AWQ" in awq_int8 and str(folders["awq"]) in awq_int8 and "--quant int8" in awq_int8
    awq_none = error_of(invoke("--model", str(folders["awq"]), *base, "--quant", "none"))
    assert "AWQ" in awq_none and "--quant none" in awq_none
    narrow = error_of(invoke("--model", str(folders["tied"]), *base, "--quant", "int4"))
    assert "q_proj" in narrow and "[64, 32]" in narrow and "128" in narrow
    assert "--quant int8" in narrow
    unknown = error_of(invoke("--model", str(folders["tied"]), *base, "--quant", "fp8"))
    assert "'fp8'" in unknown and "int4" in unknown
    backend = error_of(invoke("--model", str(folders["tied"]), *base, "--backend", "tensorrt"))
    assert "'tensorrt'" in backend and "cupy" in backend
    graphs = error_of(invoke("--model", str(folders["tied"]), *base, "--backend", "torch",
                             "--no-graphs"))
    assert "--no-graphs" in graphs and "cupy" in graphs


def test_default_backend_on_cpu_is_torch_without_graphs(folders):
    report = run_json(folders["tied"], "--device", "cpu", "--no-graphs")
    assert (report["backend"], report["graphs"], report["quant"]) == ("torch", False, "none")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cupy_backend_without_cuda_names_what_is_missing(folders):
    message = error_of(invoke("--model", str(folders["tied"]), "--prompt-ids", "1",
                              "--max-new-tokens", "1", "--backend", "cupy"))
    assert "CUDA device" in message and "--device cuda" in message
    assert 'pip install -e ".[cuda13]"' in message and '".[cuda12]"' in message
    assert "--backend torch" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_installed_command_exits_2_without_traceback_for_cupy_on_cpu(folders):
    exe = shutil.which("kestrel")
    if exe is None:
        pytest.skip("the kestrel console command is not installed (pip install -e .)")
    bad = subprocess.run(
        [exe, "generate", "--model", str(folders["tied"]), "--prompt-ids", "1",
         "--max-new-tokens", "1", "--backend", "cupy", "--device", "cpu"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "error:" in bad.stderr and "cuda13" in bad.stderr


def test_loading_entry_point_routes_awq_folders(folders):
    from kestrel_rt.loading import is_awq_checkpoint, load_model

    assert is_awq_checkpoint(folders["awq"]) and not is_awq_checkpoint(folders["wide_moe16"])
    shape, weights, _ = load_model(folders["awq"], "cpu")
    assert isinstance(weights["model.layers.0.mlp.experts.1.down_proj.weight"], Int4Weight)
    assert weights["model.embed_tokens.weight"].dtype == torch.float32  # CPU default for AWQ
    assert shape.num_experts == WIDE["wide_moe"]["num_experts"]
