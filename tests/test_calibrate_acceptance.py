"""`kestrel calibrate --draft-quant`: the organic pair's acceptance measured as served (CPU
torch backend here, tiny models): greedy rounds whose counts add up and equal the spec
decoder's own statistics, written into the Profile's `acceptance` block, planned with its
time in the estimate; no block without --draft-quant."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_models
from typer.testing import CliRunner

from calibration import acceptance
from calibration.acceptance import measure_pair
from calibration.grid import load_grid
from calibration.plan import Request, make_plan
from kestrel_cli.app import app
from kestrel_rt.runner import build_model
from kestrel_rt.serve.requests import prompt_ids
from kestrel_sim.measured_acceptance import MeasuredAcceptance, agreement, round_lengths
from kestrel_sim.profile import Profile

QUANT = "int4-last-1"  # the last of two layers in int4, the first in int8
GRID = """timing: {cpu_warmup: 1, cpu_repeats: 1}
decode: {batches: [1], contexts: [8]}
verify: {batches: [1], k: [1, 3], contexts: [8]}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3 whose projections int4 can take (in_features a multiple of 128)."""
    cfg = dict(tiny_models.CONFIGS["tied"], hidden_size=128, intermediate_size=256,
               head_dim=32)
    path = tmp_path_factory.mktemp("int4able")
    tiny_models.from_config(cfg).save_pretrained(path)
    return path


def test_the_rounds_counts_add_up_and_equal_the_decoders(folder):
    target = build_model(folder, "cpu")
    draft = build_model(folder, "cpu", quant=QUANT)
    prompts = prompt_ids(0, np.full(3, 40), target.shape.vocab_size)
    k, rounds = 3, 5
    lengths, stats = measure_pair(target, draft, prompts, k, rounds)
    assert len(lengths) == 3 * rounds and all(0 <= n <= k for n in lengths)
    block = MeasuredAcceptance.from_lengths(
        lengths, k, draft_model=str(folder), draft_quant=QUANT, device="cpu",
        draft_device="cpu", dtype="float32", backend="torch", prompts=3, prompt_tokens=40,
        rounds=rounds)
    # the lengths the rounds emitted, counted apart, are what the decoder recorded
    assert stats.num_drafts == block.drafts == block.reached[0] == 15
    assert stats.draft_tokens == k * 15
    assert block.reached == stats.reached_at and block.accepted == stats.accepted_at
    assert block.conditional_rates == pytest.approx(stats.conditional_rates(), abs=1e-6)
    assert block.unconditional_rates() == pytest.approx(stats.per_position_rates())
    assert all(0 <= r <= 1 for r in block.conditional_rates)
    assert 0 < block.conditional_rates[0] < 1  # a quantized copy: it agrees, not always
    # each sequence's agreement string: its own rounds' lengths, in order
    sequences = [agreement(lengths[j::3], k) for j in range(3)]
    assert [round_lengths(bits, k) for bits in sequences] == [lengths[j::3] for j in range(3)]
    with_sequences = block.model_copy(update={"sequences": sequences})
    assert MeasuredAcceptance.model_validate(with_sequences.model_dump()) == with_sequences


def test_a_sequences_agreement_does_not_depend_on_k(folder):
    """The premise of replaying one string at any k: where rounds at k = 3 and at k = 1
    both know a position's bit (not a bonus '?'), it is the same."""
    target = build_model(folder, "cpu")
    draft = build_model(folder, "cpu", quant=QUANT)
    prompts = prompt_ids(1, np.full(2, 40), target.shape.vocab_size)
    strings = {}
    for k, rounds in ((3, 6), (1, 12)):
        lengths, _ = measure_pair(target, draft, prompts, k, rounds)
        strings[k] = [agreement(lengths[j::2], k) for j in range(2)]
    for a, b in zip(strings[3], strings[1]):
        both = [(x, y) for x, y in zip(a, b) if "?" not in (x, y)]
        assert len(both) >= 8 and all(x == y for x, y in both), (a, b)


def invoke(*args: str):
    return CliRunner().invoke(app, ["calibrate", *args])


@pytest.fixture()
def small_measurement(monkeypatch):
    """A few rounds of a few prompts: the test's time, not the default's."""
    monkeypatch.setattr(acceptance, "ROUNDS", {"gpu": 4, "cpu": 4})
    monkeypatch.setattr(acceptance, "PROMPTS", {"gpu": 2, "cpu": 2})


def test_calibrate_writes_the_block(folder, tmp_path, small_measurement):
    grid = tmp_path / "g.yaml"
    grid.write_text(GRID)
    out = tmp_path / "p.json"
    args = ("--model", str(folder), "--draft", str(folder), "--draft-quant", QUANT,
            "--device", "cpu", "--grid", str(grid))
    dry = invoke(*args, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "also measured: the pair's acceptance: 2 prompts of" in dry.output
    result = invoke(*args, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "measured the pair's acceptance" in result.output
    block = Profile.load(out).acceptance
    assert block is not None
    assert (block.k, block.prompts, block.rounds, block.drafts) == (3, 2, 4, 8)  # k: grid's
    assert (block.draft_quant, block.draft_device, block.dtype, block.backend) == (
        QUANT, "cpu", "float32", "torch")
    assert block.draft_model == str(folder.resolve())
    assert block.prompt_tokens == 256 - (1 + 4 * 4)  # the context's room for the rounds
    assert sum(block.accepted) <= sum(block.reached) and block.seconds > 0
    # one agreement string per prompt, of its 4 rounds, whose lengths count into the block
    assert len(block.sequences) == 2
    lengths = [n for bits in block.sequences for n in round_lengths(bits, 3)]
    assert len(lengths) == 8
    assert MeasuredAcceptance.from_lengths(lengths, 3, **block.model_dump(
        exclude={"k", "drafts", "reached", "accepted", "conditional_rates"})) == block


def test_no_block_without_a_draft_quant(folder, tmp_path):
    grid, name = load_grid("tiny")
    plain = make_plan(Request(str(folder), grid, name, "tiny", "cpu", str(folder)))
    assert plain.acceptance is None and "acceptance" not in plain.estimate.builds
    organic = make_plan(Request(str(folder), grid, name, "tiny", "cpu", str(folder),
                                draft_quant=QUANT))
    assert organic.acceptance.k == 3  # the tiny grid's largest verify k
    assert organic.estimate.builds["acceptance"] > 0
    assert organic.estimate.seconds > plain.estimate.seconds


def test_a_plan_for_the_h200_measures_the_organic_pair_there():
    grid, name = load_grid("default")
    plan = make_plan(Request("qwen3-0.6b", grid, name, "default", "cuda", "qwen3-0.6b", "gpu",
                             draft_quant="int4-last-14"))
    ap = plan.acceptance
    assert (ap.k, ap.prompt_tokens, ap.draft_device) == (8, 512, "gpu")
    assert (ap.target.dtype, ap.draft.dtype, ap.draft.quant) == ("bfloat16", "bfloat16",
                                                                  "int4-last-14")
    assert plan.estimate.builds["acceptance"] < 60  # a small part of the calibration


def test_ray_leaves_the_acceptance_out_and_says_so():
    """Ray's workers measure grid points only: a plan for --ray drops the acceptance step,
    its time and its 'also measured' note, and says it is not measured."""
    from calibration.plan import without_acceptance

    grid, name = load_grid("default")
    plan = make_plan(Request("qwen3-0.6b", grid, name, "default", "cuda", "qwen3-0.6b", "gpu",
                             draft_quant="int4-last-14"))
    ray = without_acceptance(plan, "run without --ray to measure it")
    assert ray.acceptance is None and "acceptance" not in ray.estimate.builds
    assert ray.estimate.seconds < plan.estimate.seconds
    assert not [n for n in ray.notes if n.startswith("also measured")]
    assert any(n.startswith("not measured: the pair's acceptance") and "--ray" in n
               for n in ray.notes)
    assert without_acceptance(ray, "again") is ray
