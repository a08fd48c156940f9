"""`kestrel generate`: output equals transformers' generate; bad input is a clean error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiny_models
from generate_cli import error_of, invoke

from kestrel_sim.models import PRESETS

PROMPT = [5, 17, 3, 88, 41]

WORDS = ["<unk>", "<eos>", "the", "kestrel", "hovers", "over", "a", "field", "and", "dives"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny checkpoints by name, built once for this module."""
    return {
        name: tiny_models.build(name, tmp_path_factory.mktemp(name))
        for name in ("tied", "sharded", "moe")
    }


def add_tokenizer(folder):
    """A word-level tokenizer over WORDS saved into `folder` (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(folder)
    return fast


def reference_greedy(folder, prompt: list[int], n: int) -> list[int]:
    model = tiny_models.reference(folder)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["tied", "sharded", "moe"])
def test_json_ids_equal_transformers_greedy(folders, name):
    folder = folders[name]
    result = invoke("--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
                    "--max-new-tokens", "12", "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["token_ids"] == reference_greedy(folder, PROMPT, 12)
    assert report["prompt_tokens"] == len(PROMPT) and report["generated_tokens"] == 12
    assert report["tokens_per_s"] > 0 and report["elapsed_s"] > 0
    assert (report["model"], report["device"], report["dtype"]) == (str(folder), "cpu", "float32")
    assert (report["backend"], report["quant"], report["graphs"]) == ("torch", "none", False)


def test_plain_output_prints_ids_and_rate(folders):
    result = invoke("--model", str(folders["tied"]), "--prompt-ids", "1, 2, 3",
                    "--max-new-tokens", "4", "--device", "cpu")
    assert result.exit_code == 0, result.output
    first = result.stdout.strip().splitlines()[0]
    assert first == ",".join(map(str, reference_greedy(folders["tied"], [1, 2, 3], 4)))
    assert "tok/s" in result.output


def test_prompt_text_uses_the_folder_tokenizer(folders, tmp_path):
    folder = tiny_models.build("tied", tmp_path / "with_tokenizer")
    tokenizer = add_tokenizer(folder)
    text = "the kestrel hovers over a field"
    result = invoke("--model", str(folder), "--prompt", text, "--max-new-tokens", "6",
                    "--json", "--ignore-eos", "--device", "cpu")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    ids = tokenizer(text)["input_ids"]
    assert report["prompt_tokens"] == len(ids) == 6
    assert report["token_ids"] == reference_greedy(folder, ids, 6)
    assert report["text"] == tokenizer.decode(report["token_ids"], skip_special_tokens=True)


def test_sampling_is_reproducible_for_a_seed(folders):
    args = ("--model", str(folders["moe"]), "--prompt-ids", "7,8,9", "--max-new-tokens", "10",
            "--temperature", "1.0", "--top-p", "0.9", "--json", "--device", "cpu")
    first = json.loads(invoke(*args, "--seed", "11").stdout)["token_ids"]
    again = json.loads(invoke(*args, "--seed", "11").stdout)["token_ids"]
    assert first == again and len(first) == 10
    assert all(0 <= t < 96 for t in first)


def test_preset_runs_on_dummy_weights(monkeypatch):
    """A preset name runs on random weights of the preset's shapes (trimmed here for speed)."""
    small = PRESETS["qwen3-0.6b"].model_copy(
        update={"num_hidden_layers": 2, "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16}
    )
    monkeypatch.setitem(PRESETS, "qwen3-0.6b", small)
    result = invoke("--model", "qwen3-0.6b", "--prompt-ids", "1,2,3", "--max-new-tokens", "5",
                    "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["token_ids"]) == 5 and report["text"] is None
    assert all(0 <= t < 256 for t in report["token_ids"])


def test_both_or_neither_prompt(folders):
    model = ("--model", str(folders["tied"]), "--max-new-tokens", "2")
    both = error_of(invoke(*model, "--prompt", "hi", "--prompt-ids", "1"))
    neither = error_of(invoke(*model))
    assert "exactly one of --prompt" in both and "both" in both and "neither" in neither


def test_prompt_text_without_a_tokenizer(folders):
    message = error_of(invoke("--model", str(folders["tied"]), "--prompt", "hello",
                              "--max-new-tokens", "2"))
    assert "tokenizer" in message and str(folders["tied"]) in message and "--prompt-ids" in message


def test_prompt_longer_than_the_context(folders):
    # tiny models have max_position_embeddings 256
    ids = ",".join(["1"] * 250)
    message = error_of(invoke("--model", str(folders["tied"]), "--prompt-ids", ids,
                              "--max-new-tokens", "10"))
    assert "250 tokens" in message and "is 10" in message and "256" in message


@pytest.mark.parametrize("ids, words", [("1,x,3", "'x' is not a token id"), ("1,96", "id 96")])
def test_bad_prompt_ids(folders, ids, words):
    message = error_of(invoke("--model", str(folders["tied"]), "--prompt-ids", ids,
                              "--max-new-tokens", "2"))
    assert words in message


def test_unknown_preset_and_missing_folder(tmp_path):
    unknown = error_of(invoke("--model", "qwen3-7b", "--prompt-ids", "1", "--max-new-tokens", "1"))
    assert "qwen3-7b" in unknown and "qwen3-8b" in unknown
    missing = error_of(invoke("--model", str(tmp_path), "--prompt-ids", "1",
                              "--max-new-tokens", "1"))
    assert "no config.json" in missing


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda(folders):
    message = error_of(invoke("--model", str(folders["tied"]), "--prompt-ids", "1",
                              "--max-new-tokens", "1", "--device", "cuda"))
    assert "no CUDA device" in message and "--device cpu" in message


def test_usage_errors_exit_2(folders):
    result = invoke("--model", str(folders["tied"]), "--prompt-ids", "1", "--max-new-tokens", "0")
    assert result.exit_code == 2


def kestrel_command() -> list[str]:
    exe = shutil.which("kestrel")
    if exe is None:
        pytest.skip("the kestrel console command is not installed (pip install -e .)")
    return [exe]


def test_installed_command_runs_and_reports_errors_without_traceback(folders):
    folder = folders["moe"]
    ok = subprocess.run(
        [*kestrel_command(), "generate", "--model", str(folder), "--prompt-ids", "4,5,6",
         "--max-new-tokens", "6", "--json", "--device", "cpu"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["token_ids"] == reference_greedy(folder, [4, 5, 6], 6)
    (folder.parent / "broken").mkdir(exist_ok=True)
    bad = subprocess.run(
        [*kestrel_command(), "generate", "--model", str(folder.parent / "broken"),
         "--prompt-ids", "1", "--max-new-tokens", "1"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "error:" in bad.stderr and "config.json" in bad.stderr


def test_cli_imports_without_torch():
    """The simulator's CLI must load without torch: generate imports it lazily."""
    code = "import sys, kestrel_cli.app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cupy"])
@pytest.mark.parametrize("name", ["sharded", "moe"])
def test_cuda_fp32_ids_equal_transformers_greedy(folders, name, backend):
    if backend == "cupy":
        pytest.importorskip("cupy")
    folder = folders[name]
    result = invoke("--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
                    "--max-new-tokens", "12", "--json", "--device", "cuda", "--dtype", "float32",
                    "--backend", backend)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["device"] == "cuda" and report["dtype"] == "float32"
    assert (report["backend"], report["graphs"]) == (backend, backend == "cupy")
    assert report["token_ids"] == reference_greedy(folder, PROMPT, 12)


@pytest.mark.gpu
def test_cuda_default_backend_is_cupy_when_installed(folders):
    pytest.importorskip("cupy")
    result = invoke("--model", str(folders["tied"]), "--prompt-ids", "1,2,3",
                    "--max-new-tokens", "3", "--json", "--device", "cuda", "--no-graphs")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["backend"], report["graphs"], report["dtype"]) == ("cupy", False, "float32")


def test_eos_from_config_json_stops_as_transformers_does(folders, tmp_path):
    """Without generation_config.json, transformers' generate stops at config.json's
    eos_token_id; so does kestrel generate."""
    folder = tmp_path / "eos"
    shutil.copytree(folders["tied"], folder)
    (folder / "generation_config.json").unlink()
    free = reference_greedy(folder, PROMPT, 8)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = free[3]
    (folder / "config.json").write_text(json.dumps(config))
    model = tiny_models.reference(folder)
    ids = torch.tensor([PROMPT])
    theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=8)[0, len(PROMPT):].tolist()
    assert theirs == free[: free.index(free[3]) + 1]
    args = ("--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-new-tokens", "8", "--json", "--device", "cpu")
    assert json.loads(invoke(*args).stdout)["token_ids"] == theirs
    assert json.loads(invoke(*args, "--ignore-eos").stdout)["token_ids"] == free
    (folder / "generation_config.json").write_text('{"eos_token_id": "</s>"}')
    message = error_of(invoke(*args))
    assert "generation_config.json" in message and "'</s>'" in message


@pytest.mark.parametrize("option, value, words", [
    ("--seed", str(2**70), "seed 1180591620717411303424"),
    ("--seed", "-1", "seed -1"),
    ("--temperature", "inf", "temperature is inf"),
    ("--top-p", "0", "top_p is 0.0"),
])
def test_bad_sampling_options_are_user_errors(folders, option, value, words):
    message = error_of(invoke("--model", str(folders["tied"]), "--prompt-ids", "1,2",
                              "--max-new-tokens", "2", "--temperature", "1", f"{option}={value}"))
    assert words in message


def test_a_model_larger_than_free_memory_is_refused_before_loading(folders, monkeypatch):
    import kestrel_rt.weights as weights_mod
    from kestrel_rt import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 10_000)
    monkeypatch.setattr(weights_mod, "dummy_weights", None)  # a load would fail loudly
    message = error_of(invoke("--model", "qwen3-32b", "--prompt-ids", "1,2",
                              "--max-new-tokens", "2", "--device", "cpu"))
    assert ("'qwen3-32b' needs 131.1 GB in float32 (131.0 GB of weights, 2.10 MB of KV cache "
            "for 4 tokens), but cpu has 0.01 MB free") in message
    message = error_of(invoke("--model", str(folders["tied"]), "--prompt-ids", "1,2",
                              "--max-new-tokens", "2", "--device", "cpu"))
    assert "(0.10 MB of weights" in message and folders["tied"].name in message


@pytest.mark.parametrize("files", [
    {"tokenizer.json": "garbage{"},
    {"tokenizer.json": json.dumps({"version": "1.0", "added_tokens": [], "normalizer": None,
                                   "pre_tokenizer": None, "post_processor": None,
                                   "decoder": None, "model": {"type": "Nope"}})},
    {"tokenizer_config.json": '{"tokenizer_class": "NoSuchTokenizer"}'},
])
def test_broken_tokenizer_files_are_a_one_paragraph_error(folders, tmp_path, files):
    folder = tmp_path / "badtok"
    shutil.copytree(folders["tied"], folder)
    for name, text in files.items():
        (folder / name).write_text(text)
    message = error_of(invoke("--model", str(folder), "--prompt-ids", "1,2",
                              "--max-new-tokens", "2"))
    assert "tokenizer files in" in message and str(folder) in message


def test_a_hub_id_runs_from_the_local_cache_and_is_never_downloaded(folders, tmp_path,
                                                                     monkeypatch):
    """`--model Qwen/Qwen3-8B` as vLLM takes it: the local Hugging Face cache's snapshot."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-qwen"
    shutil.copytree(folders["sharded"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke("--model", "acme/tiny-qwen", "--prompt-ids", ",".join(map(str, PROMPT)),
                    "--max-new-tokens", "6", "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["token_ids"] == reference_greedy(folders["sharded"], PROMPT, 6)
    assert report["model"] == "acme/tiny-qwen"
    plain = invoke("--model", "acme/tiny-qwen", "--prompt-ids", "1", "--max-new-tokens", "1",
                   "--device", "cpu")
    assert "tiny-qwen on cpu" in plain.output
    message = error_of(invoke("--model", "acme/not-cached", "--prompt-ids", "1",
                              "--max-new-tokens", "1"))
    assert "does not exist" in message and "hf download acme/not-cached" in message
