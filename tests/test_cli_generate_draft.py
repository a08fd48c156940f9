"""`kestrel generate --draft`: the same token ids as plain greedy, vLLM's statistics."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_models
from generate_cli import error_of, invoke

PROMPT = "5,17,3,88,41"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target, a different tiny draft of the same vocabulary, and a moe target."""
    made = {name: tiny_models.build(name, tmp_path_factory.mktemp(name))
            for name in ("untied", "tied", "moe")}
    return made


def run(*args: str) -> dict:
    result = invoke("--prompt-ids", PROMPT, "--max-new-tokens", "14", "--json", "--device",
                    "cpu", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("correction", ["fused", "separate"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_speculative_ids_equal_plain_greedy(folders, k, correction):
    plain = run("--model", str(folders["untied"]))
    spec = run("--model", str(folders["untied"]), "--draft", str(folders["tied"]), "--k",
               str(k), "--correction", correction)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["correction"] == correction and spec["spec_decode_k"] == k
    assert spec["spec_decode_num_drafts"] > 0
    assert 0 <= spec["spec_decode_accepted_tokens"] <= spec["spec_decode_draft_tokens"]
    assert spec["spec_decode_acceptance_length"] == pytest.approx(
        1 + spec["spec_decode_accepted_tokens"] / spec["spec_decode_num_drafts"])
    assert len(spec["spec_decode_per_position_acceptance_rates"]) == k
    assert not spec["spec_decode_controlled"]


def test_a_draft_equal_to_its_target_accepts_everything(folders):
    spec = run("--model", str(folders["untied"]), "--draft", str(folders["untied"]), "--k", "4")
    assert spec["spec_decode_acceptance_rate"] == pytest.approx(100.0)
    assert spec["rounds_ahead"] == 0  # organic acceptance: each round read before the next


def test_controlled_acceptance_is_marked_and_keeps_the_work(folders):
    spec = run("--model", str(folders["moe"]), "--draft", str(folders["tied"]), "--k", "4",
               "--alpha", "0.5")
    assert spec["spec_decode_controlled"] and spec["spec_decode_num_drafts"] > 0
    # one sequence: every round but a last one with nothing left to propose is a draft;
    # controlled fused rounds on one device run ahead
    assert spec["spec_decode_num_drafts"] <= spec["rounds"] <= spec["spec_decode_num_drafts"] + 1
    assert 0 < spec["rounds_ahead"] < spec["rounds"]


@pytest.mark.parametrize("args,words", [
    (("--k", "0"), "--k 0"),
    (("--k", "17"), "expected 1..16"),
    (("--correction", "both"), "--correction 'both'"),
])
def test_bad_draft_options_are_clear_errors(folders, args, words):
    result = invoke("--model", str(folders["untied"]), "--draft", str(folders["tied"]),
                    "--prompt-ids", PROMPT, "--max-new-tokens", "4", "--device", "cpu", *args)
    assert words in error_of(result)


def test_a_draft_of_another_vocabulary_is_refused(folders, tmp_path):
    other = tmp_path / "other"
    tiny_models.from_config(dict(tiny_models.CONFIGS["tied"], vocab_size=80)).save_pretrained(
        other)
    result = invoke("--model", str(folders["untied"]), "--draft", str(other), "--prompt-ids",
                    PROMPT, "--max-new-tokens", "4", "--device", "cpu")
    assert "vocab_size" in error_of(result)
