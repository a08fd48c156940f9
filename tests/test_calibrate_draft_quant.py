"""`kestrel calibrate --draft-quant`: the draft built quantized on every bench that builds it
(a tiny model's int8 copy on the CPU; the organic pair's plan for a GPU), recorded in the
profile's fingerprint and in the plan's text; a value the scenario's draft.quant would not
take, or that cannot apply to the draft, refused naming --draft-quant."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_models
from typer.testing import CliRunner

import kestrel_rt.runner
from calibration.estimate import QUANT_BYTES, projection_bytes
from calibration.grid import load_grid
from calibration.plan import Request, make_plan
from kestrel_cli.app import app
from kestrel_rt.quant_weights import Int8Weight, QuantizedWeight
from kestrel_sim.errors import KestrelError
from kestrel_sim.profile import Profile

runner = CliRunner()
GRID = """timing: {cpu_warmup: 1, cpu_repeats: 1}
decode: {batches: [1], contexts: [8]}
draft:
  cpu: {batches: [1, 2], contexts: [8], new_tokens: [1]}
"""


def invoke(*args: str):
    return runner.invoke(app, ["calibrate", *args])


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return tiny_models.build("tied", tmp_path_factory.mktemp("tied"))


@pytest.fixture()
def quantized_builds(monkeypatch):
    """Each weight quantization a model build runs: (mode, the weights after it)."""
    seen, real = [], kestrel_rt.runner.quantize_weights

    def spy(weights, mode, layers=None):
        out = real(weights, mode, layers)
        seen.append((mode, dict(out)))
        return out

    monkeypatch.setattr(kestrel_rt.runner, "quantize_weights", spy)
    return seen


def test_an_int8_copy_of_the_target_is_measured_as_the_draft(tied, tmp_path,
                                                             quantized_builds):
    grid = tmp_path / "g.yaml"
    grid.write_text(GRID)
    out = tmp_path / "p.json"
    result = invoke("--model", str(tied), "--draft", str(tied), "--draft-quant", "int8",
                    "--device", "cpu", "--grid", str(grid), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert f"+ draft {tied} (int8)" in result.output
    profile = Profile.load(out)
    fp = profile.fingerprint
    assert (fp.quant, fp.draft_quant, fp.draft_device) == ("none", "int8", "cpu")
    assert fp.options["target@cpu"]["quant"] == "none"
    assert fp.options["draft@cpu"]["quant"] == "int8"
    assert {(m.stage, m.batch) for m in profile.rows("draft", "cpu")} == {("draft", 1),
                                                                          ("draft", 2)}
    # two builds: the target as it is, then the draft, every projection of it in int8; and
    # the pair again, built as served, for its acceptance (tests/test_calibrate_acceptance.py)
    assert [mode for mode, _ in quantized_builds] == [None, "int8"] * 2
    assert profile.acceptance is not None and profile.acceptance.draft_quant == "int8"
    target, draft = (weights for _, weights in quantized_builds[:2])
    assert not any(isinstance(w, QuantizedWeight) for w in target.values())
    projections = [n for n in draft if n.endswith("_proj.weight")]
    assert len(projections) == 7 * 2  # q, k, v, o, gate, up, down of both layers
    assert all(isinstance(draft[n], Int8Weight) for n in projections)


def test_without_draft_quant_the_fingerprint_says_none(tied, tmp_path, quantized_builds):
    grid = tmp_path / "g.yaml"
    grid.write_text(GRID)
    out = tmp_path / "p.json"
    result = invoke("--model", str(tied), "--draft", str(tied), "--device", "cpu",
                    "--grid", str(grid), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert Profile.load(out).fingerprint.draft_quant == "none"
    assert [mode for mode, _ in quantized_builds] == [None, None]


@pytest.mark.parametrize(("args", "expected"), [
    (("--draft-quant", "int3"), "--draft-quant 'int3' is not a quantization"),
    (("--draft-quant", "int4-last-x"), "--draft-quant 'int4-last-x' is not a quantization"),
    (("--draft-quant", "int4"), "--draft-quant int4 cannot apply to draft folder"),
    (("--draft-quant", "int4-last-9"), "--draft-quant int4-last-9: draft folder"),
])
def test_a_draft_quant_that_cannot_apply_is_refused(tied, args, expected):
    result = invoke("--model", str(tied), "--draft", str(tied), *args, "--device", "cpu",
                    "--grid", "tiny", "--dry-run")
    assert isinstance(result.exception, KestrelError)  # `kestrel` prints it, exits 2
    assert expected in str(result.exception)


def test_draft_quant_needs_a_draft(tied):
    result = invoke("--model", str(tied), "--draft-quant", "int8", "--device", "cpu",
                    "--grid", "tiny", "--dry-run")
    assert isinstance(result.exception, KestrelError)
    assert "--draft-quant int8 quantizes the draft, but no --draft" in str(result.exception)


def test_a_bad_draft_quant_exits_2_without_a_traceback():
    done = subprocess.run([sys.executable, "-m", "kestrel_cli.app", "calibrate", "--model",
                           "qwen3-0.6b", "--draft", "qwen3-0.6b", "--draft-quant", "int4-14",
                           "--dry-run"], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "--draft-quant 'int4-14' is not a quantization" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_organic_pairs_plan_quantizes_every_draft_it_builds():
    grid, name = load_grid("default")
    plan = make_plan(Request("qwen3-0.6b", grid, name, "default", "cuda", "qwen3-0.6b",
                             "gpu", draft_quant="int4-last-14"))
    benches = {b.name: b for b in plan.benches}
    assert set(benches) == {"target@gpu", "draft@gpu", "pair@gpu", "spec@gpu"}
    assert benches["draft@gpu"].quant == "int4-last-14"
    assert benches["spec@gpu"].draft.quant == "int4-last-14"  # the round bench's draft
    assert benches["target@gpu"].quant is None and benches["pair@gpu"].quant is None
    assert benches["spec@gpu"].quant is None  # the target beside it


def test_int4_last_n_is_estimated_between_int8_and_int4():
    mixed = projection_bytes("int4-last-14", 28)
    assert QUANT_BYTES["int4"] < mixed < QUANT_BYTES["int8"]
    assert projection_bytes("int4-last-0", 28) == QUANT_BYTES["int8"]
    assert projection_bytes("int4-last-40", 28) == QUANT_BYTES["int4"]
    assert projection_bytes(None, 28) is None
